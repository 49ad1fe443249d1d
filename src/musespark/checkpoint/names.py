"""The released tensor names and shapes of the text decoder (docs/spec.md §1).

Names here are relative to the text model ("embed_tokens.weight", "layers.0...."),
plus "lm_head.weight" at the top. On disk, nested checkpoints prefix the text model
with "model.language_model.", flat ones with "model.".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig

NESTED_PREFIX = "model.language_model."
FLAT_PREFIX = "model."
LM_HEAD = "lm_head.weight"
EMBED = "embed_tokens.weight"

# Non-text parts of the omni checkpoint (under "model."): skipped when loading.
TOWER_PREFIXES = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.vision_adapter.",
    "model.vision_projection.",
    "model.perception_emb_norm.",
    "model.multi_modal_projector.",
)

# Tensors kept in float32 whatever the model dtype (docs/spec.md §1, §2).
FP32_SUFFIXES = (
    "post_attention_residual_gate.gate",
    "post_feedforward_residual_gate.gate",
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
)


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor a module needs: its shape and, when fixed by the format, its
    dtype. `dtype=None`: any float dtype on disk, converted to the model dtype when read;
    float32 (gates, router, global scales): any float dtype, widened to fp32; any other
    dtype (packed uint8 codes, fp8-e4m3 block scales): exactly that dtype on disk."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    # A tensor-parallel shard: the checkpoint holds the whole tensor and this rank reads
    # only `pieces` ((start, length) ranges, concatenated) along `dim`; `shape` is then the
    # local shape. Ranges past the tensor's end are zero-filled (a padded vocabulary block).
    shard: Shard | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape the checkpoint holds."""
        if self.shard is None:
            return self.shape
        d = self.shard.dim
        return self.shape[:d] + (self.shard.full,) + self.shape[d + 1 :]


@dataclass(frozen=True)
class Shard:
    dim: int
    pieces: tuple[tuple[int, int], ...]  # (start, length) along dim, in order
    full: int  # the checkpoint tensor's size along dim

    @classmethod
    def range(cls, dim: int, start: int, length: int, full: int) -> Shard:
        return cls(dim, ((start, length),), full)


def dense_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """`expected_shapes` as specs: fp32 where `keeps_fp32`, else the model dtype."""
    return {
        name: TensorSpec(shape, torch.float32 if keeps_fp32(name) else None)
        for name, shape in expected_shapes(cfg).items()
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text tensor a checkpoint of `cfg` holds, with its shape (lm_head included)."""
    H, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nH, nKV = cfg.num_attention_heads, cfg.num_key_value_heads
    E, Hm, Im, I = cfg.num_local_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (nH * D, H),
                p + "self_attn.k_proj.weight": (nKV * D, H),
                p + "self_attn.v_proj.weight": (nKV * D, H),
                p + "self_attn.gate_proj.weight": (nH * D, H),
                p + "self_attn.o_proj.weight": (H, nH * D),
                p + "post_attention_residual_gate.gate": (H,),
                p + "pre_feedforward_layernorm.weight": (H,),
                p + "post_feedforward_layernorm.weight": (H,),
                p + "post_feedforward_residual_gate.gate": (H,),
            }
        )
        if cfg.is_sparse(i):
            shapes.update(
                {
                    p + "mlp.gate.weight": (E, H),
                    p + "mlp.gate.e_score_correction_bias": (E,),
                    p + "mlp.pre_expert_proj.weight": (Hm, H),
                    p + "mlp.pre_expert_norm.weight": (Hm,),
                    p + "mlp.experts.gate_up_proj": (E, 2 * Im, Hm),
                    p + "mlp.experts.down_proj": (E, Hm, Im),
                    p + "mlp.experts.post_expert_norm.weight": (Hm,),
                    p + "mlp.post_expert_proj.weight": (H, Hm),
                }
            )
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (I, H),
                    p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I),
                }
            )
    shapes["norm.weight"] = (H,)
    shapes[LM_HEAD] = (V, H)
    return shapes


def to_relative(name: str) -> str | None:
    """Map an on-disk name to our relative name; None for tower tensors to skip.

    Names that are neither text nor tower come back unchanged, so the caller reports
    them as unexpected.
    """
    if name == LM_HEAD:
        return name
    if name.startswith(NESTED_PREFIX):
        return name[len(NESTED_PREFIX) :]
    if name.startswith(TOWER_PREFIXES):
        return None
    if name.startswith(FLAT_PREFIX):
        return name[len(FLAT_PREFIX) :]
    return name
