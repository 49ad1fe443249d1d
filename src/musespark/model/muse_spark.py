"""The Muse Spark 1x text decoder (docs/spec.md §2-3).

Module names follow the checkpoint's tensor names, so loading is mechanical:
`model.state_dict()` keys are exactly `checkpoint.names.expected_shapes(cfg)`.

The residual stream `s` is float32 from the embedding norm to the final norm, whatever
the model dtype; weights and matmuls run in the model dtype; logits are float32.

Modules hold weights (each linear and the experts through a weight format, `quant/`);
the model's compute backend (`backends/`, chosen once by `load_model`) computes each step.
`DecoderLayer.forward` is the one forward path of a layer, whatever the backend (a backend
may run a whole step in one call, `Backend.decode_forward`, only with the same bits).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import Backend, TorchBackend
from ..checkpoint.names import Shard, TensorSpec
from ..config import ModelConfig
from ..layers.attention import AttentionContext
from ..layers.linear import Linear
from ..layers.moe import DenseMlp, SparseMoeBlock
from ..layers.norm import ResidualGate, RMSNorm
from ..layers.rotary import RopeTable, inv_frequencies
from ..parallel.state import SINGLE, ParallelContext
from ..quant import WeightFormats

Rope = dict[float, tuple[torch.Tensor, torch.Tensor]]  # rotary base -> (cos, sin) [T, D], shared within a step


class Attention(nn.Module):
    """The attention's weights and constants; the backend computes it (`Backend.attn_in`,
    `attention`, `attn_out`)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, formats: WeightFormats, prefix: str, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.layer = layer
        # Tensor parallel: this rank's heads (q/gate heads and the kv heads they read stay
        # together: nKV % tp == 0, no KV replication), o_proj row-parallel.
        h0, nh = parallel.split(cfg.num_attention_heads, "num_attention_heads")
        k0, nkv = parallel.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, D

        def rows(start: int, n: int, full: int) -> Shard | None:
            return Shard.range(0, start * D, n * D, full * D) if parallel.tp_size > 1 else None

        q_rows = rows(h0, nh, cfg.num_attention_heads)
        kv_rows = rows(k0, nkv, cfg.num_key_value_heads)
        o_cols = Shard.range(1, h0 * D, nh * D, cfg.num_attention_heads * D) if parallel.tp_size > 1 else None
        self.q_proj = Linear(H, nh * D, formats.linear(prefix + "q_proj"), q_rows)
        self.k_proj = Linear(H, nkv * D, formats.linear(prefix + "k_proj"), kv_rows)
        self.v_proj = Linear(H, nkv * D, formats.linear(prefix + "v_proj"), kv_rows)
        self.gate_proj = Linear(H, nh * D, formats.linear(prefix + "gate_proj"), q_rows)  # the output gate
        self.o_proj = Linear(nh * D, H, formats.linear(prefix + "o_proj"), o_cols, reduce=parallel)
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
        self.rope_table: RopeTable | None = None  # cos/sin by position, made at the first step

    def rotary(
        self, positions: torch.Tensor, rope: Rope, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [T, D] fp32 of this layer's base, shared through `rope` by layers of
        the same base (from this layer's `RopeTable`); None on NoPE layers. `max_position`:
        the largest of `positions`, when the caller knows it."""
        if self.rope_theta is None:
            return None
        if self.rope_theta not in rope:
            if self.inv_freq is None:
                self.inv_freq = inv_frequencies(self.rope_theta, self.head_dim).to(positions.device)
            table = self.rope_table
            if table is None or table.inv_freq is not self.inv_freq:  # made, or `.to()` moved inv_freq
                table = self.rope_table = RopeTable(self.inv_freq)
            rope[self.rope_theta] = table.lookup(positions, max_position)
        return rope[self.rope_theta]


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, formats: WeightFormats, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        H, prefix = cfg.hidden_size, f"layers.{layer}."
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, gain_center=1.0)
        self.self_attn = Attention(cfg, layer, formats, prefix + "self_attn.", parallel)
        self.post_attention_residual_gate = ResidualGate(H, cfg.residual_gate_temperature)
        self.pre_feedforward_layernorm = RMSNorm(H, cfg.rms_norm_eps, gain_center=1.0)
        self.is_sparse = cfg.is_sparse(layer)
        mlp = SparseMoeBlock if self.is_sparse else DenseMlp
        self.mlp = mlp(cfg, formats, prefix + "mlp.", parallel)
        self.post_feedforward_layernorm = RMSNorm(H, cfg.post_norm_eps, gain_center=1.0, input_scaled=True)
        self.post_feedforward_residual_gate = ResidualGate(H, cfg.residual_gate_temperature)
        self.post_norm_eps = cfg.post_norm_eps

    def forward(
        self,
        s: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        rope: Rope,
        backend: Backend,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """s [T, H] fp32 stream -> new stream [T, H] fp32; `dtype` is the activation dtype."""
        q, k, v, g = backend.attn_in(self, s, self.self_attn.rotary(positions, rope, ctx.max_position), dtype)
        o = backend.attention(self.self_attn, q, k, v, positions, ctx)
        s = backend.attn_out(self, s, o, g)
        return backend.moe_ffn(self, s, dtype) if self.is_sparse else backend.dense_ffn(self, s, dtype)


class Embedding(nn.Module):
    """A plain lookup table [V, H]. (Not `nn.Embedding`: its random init on the meta
    device pulls in heavy imports while loading; ours is filled by the loader.)

    Tensor parallel: this rank holds a block of ceil(V / tp) rows (zero-padded past V); ids
    outside it look up zeros and the TP all-reduce fills them in (one contributor: exact)."""

    def __init__(self, num_embeddings: int, dim: int, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.first, rows = parallel.vocab_split(num_embeddings) if parallel.tp_size > 1 else (0, num_embeddings)
        self.shard = Shard.range(0, self.first, rows, num_embeddings) if parallel.tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(tuple(self.weight.shape), None, self.shard)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None]
        return self.parallel.all_reduce_fp32(rows)


class MissingLayer(nn.Module):
    """A layer another pipeline stage runs: no weights here."""


class MuseSparkForCausalLM(nn.Module):
    """The text decoder. `forward` takes a flat batch and returns final hidden states.

    `backend` computes every step (default: the torch reference; `load_model` chooses one,
    and it may be replaced at any time: `model.backend = select_backend("torch", model)`). Weights are
    frozen once a backend is chosen: after changing them, call `materialize_constants()` and choose
    the backend again (a backend may keep what it derived from them, e.g. packed copies).
    `formats` gives each linear and the experts their weight format (default: dense).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        formats: WeightFormats | None = None,
        backend: Backend | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        formats = formats or WeightFormats()
        self.config = cfg
        self.parallel = parallel  # one process unless parallel/ built this rank's shard
        self.backend: Backend = backend or TorchBackend()
        # Pipeline parallel: this stage's layers [start, end); the embedding lives on the
        # first stage, the final norm and the head on the last (docs/parallel.md §6).
        self.layer_range = parallel.layer_range(cfg.num_hidden_layers)
        start, end = self.layer_range
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, parallel) if parallel.is_first_stage else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, formats, parallel) if start <= i < end else MissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = self.lm_head = None
        if parallel.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gain_center=0.0)  # plain weight
            v0, rows = parallel.vocab_split(cfg.vocab_size) if parallel.tp_size > 1 else (0, cfg.vocab_size)
            shard = Shard.range(0, v0, rows, cfg.vocab_size) if parallel.tp_size > 1 else None
            self.lm_head = Linear(cfg.hidden_size, rows, formats.linear("lm_head"), shard)  # vocab-parallel
            if cfg.tie_word_embeddings and self.embed_tokens is not None:  # a checkpoint head replaces this
                self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor().dtype

    @property
    def device(self) -> torch.device:
        return self._anchor().device

    def _anchor(self) -> torch.Tensor:
        """A model-dtype weight this rank holds (the embedding, else the final norm, else
        the first local layer's input norm)."""
        if self.embed_tokens is not None:
            return self.embed_tokens.weight
        if self.norm is not None:
            return self.norm.weight
        return self.layers[self.layer_range[0]].input_layernorm.weight

    def materialize_constants(self) -> None:
        """Compute weight-only constants (residual gate alpha/beta, fp32 norm gains) once, after loading."""
        for module in self.modules():
            if isinstance(module, (ResidualGate, RMSNorm)):
                module.materialize()
            elif isinstance(module, DecoderLayer) and module.self_attn.rope_theta is not None:
                attn = module.self_attn
                attn.inv_freq = inv_frequencies(attn.rope_theta, attn.head_dim).to(self.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, aux_layers: tuple[int, ...] = ()
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T] -> final hidden states y [T, H] in the model dtype.

        With `aux_layers` (ascending decoder layer indices; speculative drafters read them):
        (y, aux) where aux [T, len(aux_layers) * H] fp32 holds the stream after each of
        those layers (the tensor entering the next one), in that order."""
        dtype, backend, par = self.dtype, self._active_backend(), self.parallel
        if aux_layers and par.pp_size > 1:
            raise ValueError("aux_layers is not supported with pipeline parallelism")
        rope: Rope = {}
        start, end = self.layer_range
        if list(aux_layers) != sorted(set(aux_layers)) or any(not start <= i < end for i in aux_layers):
            raise ValueError(f"aux_layers {aux_layers} must be ascending, distinct layer indices in [{start}, {end})")
        aux: list[torch.Tensor] = []
        with backend.step(ctx):
            # A backend may run the whole step in one call, with the same bits (Backend.decode_forward).
            whole = (
                None
                if par.pp_size > 1
                else backend.decode_forward(self, input_ids, positions, ctx, rope, dtype, tuple(aux_layers))
            )
            if whole is not None:
                return whole
            if par.is_first_stage:
                s = backend.embed(self, input_ids)  # fp32 stream
            else:
                s = par.recv_prev((input_ids.shape[0], self.config.hidden_size), input_ids.device)
            for i in range(start, end):
                s = self.layers[i].forward(s, positions, ctx, rope, backend, dtype)  # direct: no hook dispatch
                if i in aux_layers:
                    aux.append(s.to(torch.float32, copy=True))  # a copy: later layers may update s in place
        if not par.is_last_stage:
            par.send_next(s)
            return s  # not final: only the last stage normalizes and computes logits
        y = backend.final_norm(self, s, dtype)
        if aux_layers:
            return y, torch.cat(aux, dim=-1)
        return y

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """y [N, H] -> soft-capped logits [N, V] in fp32: T * tanh(y W^T * m / T)."""
        return self._active_backend().logits(self, hidden)

    def _active_backend(self) -> Backend:
        """`self.backend`, except the torch reference when this forward must be differentiable
        (training mode, or gradients enabled on trainable weights) and the backend is not."""
        if self.backend.supports_autograd:
            return self.backend
        if self.training or (torch.is_grad_enabled() and self.embed_tokens.weight.requires_grad):
            return _REFERENCE
        return self.backend

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Reference entry point: the [len, vocab] float32 logits of one sequence."""
        ids = self._check_ids(token_ids)
        positions = torch.arange(len(token_ids), device=self.device)
        hidden = self(ids, positions, AttentionContext.for_prompts([len(token_ids)]))
        par = self.parallel
        if par.pp_size == 1:
            return self.compute_logits(hidden)
        import torch.distributed as dist  # pipeline: the last stage's logits, on every rank

        logits = (
            self.compute_logits(hidden)
            if par.is_last_stage
            else torch.empty(len(token_ids), self.config.vocab_size, dtype=torch.float32, device=self.device)
        )
        dist.broadcast(logits, src=par.stage_rank(par.pp_size - 1) - par.tp_rank)
        return logits

    @torch.inference_mode()
    def greedy_continuation(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        """Reference greedy decoding by full recompute each step (slow; for tests)."""
        ids = list(token_ids)
        for _ in range(max_new_tokens):
            ids.append(int(self.prompt_logits(ids)[-1].argmax()))
        return ids[len(token_ids) :]

    def _check_ids(self, token_ids: list[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be a flat list of ints, got shape {tuple(ids.shape)}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bool(bad.any()):
            raise ValueError(f"token_ids must lie in [0, {self.config.vocab_size}), got {int(ids[bad][0])}")
        return ids


_REFERENCE = TorchBackend()


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
