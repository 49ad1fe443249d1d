"""Helpers that build small random models with the independent reference,
`transformers==5.23.0`'s `MuseSparkForConditionalGeneration` (test-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Small text configs covering the architecture's features. Each key is a test id.
BASE: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    head_dim=16,
    moe_hidden_size=32,
    moe_intermediate_size=40,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS: dict[str, dict[str, Any]] = {
    # GQA 1, top-1, dense + sparse, default sliding/full/NoPE pattern
    "gqa1_top1": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=1,
        sliding_window=8,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
    # GQA 2, top-2, routed scaling != 1, interleaved dense/sparse
    "gqa2_top2_scaled": dict(
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        sliding_window=16,
        mlp_layer_types=["sparse", "dense", "sparse", "dense", "sparse"],
    ),
    # GQA 4, top-3 of 16, tied embeddings in the config
    "gqa4_top3_tied": dict(
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=16,
        num_experts_per_tok=3,
        sliding_window=12,
        tie_word_embeddings=True,
        routed_scaling_factor=0.75,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
    # GQA 4 with one KV head, custom layer pattern: NoPE on sliding and full layers
    "gqa4_custom_layers": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=4,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        layer_rope_theta=[0, 10000.0, 10000.0, 0],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mlp_layer_types=["sparse", "sparse", "dense", "sparse"],
    ),
    # all dense, different eps/temperature/softcap/multipliers
    "all_dense": dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=10,
        mlp_layer_types=["dense", "dense", "dense"],
        residual_gate_temperature=0.7,
        final_logit_softcapping=7.5,
        output_multiplier=0.5,
        qk_scale_factor=3.0,
        rms_norm_eps=1e-6,
        post_norm_eps=1e-6,
    ),
}


def oracle_config(text: dict[str, Any]):
    from transformers import MuseSparkConfig

    text = {**BASE, **text}
    return MuseSparkConfig(
        text_config=text,
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
        audio_config={"hidden_sizes": [8, 8, 8, 8], "out_hidden_size": text["hidden_size"]},
        out_hidden_size=128,
        projector_hidden_size=64,
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Randomize every parameter and persistent buffer (those in state_dict()).

    The library leaves norm weights, residual gates and the router bias at zero or
    constant; those would hide bugs. Rotary `inv_freq` buffers are not in the state
    dict and must keep their values.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.dtype.is_floating_point:
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith("residual_gate.gate"):
                value = noise
            elif name.endswith("e_score_correction_bias"):
                value = noise * 0.1
            elif name.endswith("language_model.norm.weight"):
                value = 1.0 + 0.2 * noise
            elif t.ndim == 1:
                value = 0.3 * noise
            elif name == "lm_head.weight":
                value = noise * 3.0 / t.shape[-1] ** 0.5
            elif name.endswith("mlp.gate.weight"):
                value = noise * 2.0 / t.shape[-1] ** 0.5
            else:
                value = noise / t.shape[-1] ** 0.5
            t.copy_(value.to(t.dtype))


def build_oracle(text: dict[str, Any], seed: int = 0):
    """A random float32 reference model in eval mode."""
    from transformers import MuseSparkForConditionalGeneration

    torch.manual_seed(seed)
    model = MuseSparkForConditionalGeneration(oracle_config(text)).eval()
    randomize_(model, seed)
    return model


def save_oracle(model, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(path), **kwargs)
    return path


@torch.no_grad()
def oracle_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def oracle_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by full recompute each step."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(oracle_logits(model, seq)[-1].argmax()))
    return seq[len(ids) :]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute logit difference, relative to the largest reference logit."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
