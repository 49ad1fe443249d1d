"""The DSpark draft's config family, `model_type = "muse_spark_dspark"` (docs/speculative.md §2).

`DSparkConfig.from_dict` parses a draft `config.json` strictly: a key that is neither a
field below nor one of the declared-but-unused keys (§2.1) is an error naming it, and so is a
missing required key (§2.2). Nested `moe` / `metap` objects are flattened into `moe_*` /
`metap_*` fields. Derived quantities (per-layer positional mode, window, gain centres, the
output multiplier) are methods taking the draft layer's *global* index `ell = L_T + i`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

MODEL_TYPE = "muse_spark_dspark"
GainCenterType = Literal[
    "one",
    "zero",
    "inverse_residual_index",
    "inverse_residual_index_v2",
    "inverse_residual_index_p1",
    "inverse_sqrt_residual_index",
]

# Declared by the parent config (or written by tooling) but not read by the draft (§2.1).
IGNORED_KEYS = frozenset(
    {
        "model_type",
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "use_fp32_for_output",
        "numerics_args",
        "normalize_tok_embeddings",
        "gated_delta_net",
        "hf_overrides",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "logit_scale",
        "output_norm_gain_center_type",
        "every_n_layers_global",
        "rope_is_neox_style",
    }
)
# Alternative names of the mask token, in resolution order after `dflash_config.mask_token_id`.
MASK_ALIASES = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
MOE_KEYS = {"is_enabled": True, "interleave_moe_layer_step": 1, "n_dense_layers_before_moe": 0}
METAP_KEYS = {
    "use_metap": False,
    "metap_mode": "mup",
    "base_width": 256,
    "router_has_one_inf_dim": True,
    "m_emb": None,
    "use_metap_output_multiplier_without_metap": None,
}


@dataclass(frozen=True)
class DSparkConfig:
    # required (undeclared in the parent class, §2.2)
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    mask_token_id: int
    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool = False  # required when the confidence head is enabled
    sample_from_anchor: bool = True
    block_size: int | None = None  # default num_speculative_tokens
    # geometry
    vocab_size: int = 202048
    draft_vocab_size: int | None = None  # None: = vocab_size
    hidden_size: int = 5120
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int | None = 8
    head_dim: int = 128
    max_position_embeddings: int = 131072
    ffn_dim_multiplier: float = 1.0
    non_linearity: str = "swiglu"
    # norms
    rms_norm_eps: float = 1e-5
    rms_post_norm_eps: float | None = None
    norm_affine: bool = True
    post_norm_affine: bool = True
    norm_zero_centered_gamma: bool = False
    post_norm_gain_center_type: GainCenterType = "one"
    use_ffn_learnable_scales: bool = False
    # attention
    use_qk_norm: bool = True
    use_attn_o_norm: bool = False
    use_attn_o_gate: bool = False
    use_sqrt_attn_scaling: bool = False
    attn_temperature_tuning_floor_scale: float | None = None
    attn_temperature_tuning_q_scale_constant: float | None = None
    attn_temperature_tuning_layers: str | None = None
    use_rope: bool = True
    rope_theta: float = 500000.0
    rope_use_fp32_in_outer_product: bool = True
    every_n_layers_nope: int | None = None
    global_attn_cfg: tuple[int | str, ...] | None = None  # None: full attention everywhere
    # residual stream and output
    use_residual_gate: bool = False
    residual_dtype: Literal["bf16", "fp32"] = "bf16"
    output_soft_cap_temp: float | None = None
    moe_is_enabled: bool = True
    moe_interleave_moe_layer_step: int = 1
    moe_n_dense_layers_before_moe: int = 0
    metap_use_metap: bool = False
    metap_metap_mode: str = "mup"
    metap_base_width: int = 256
    metap_router_has_one_inf_dim: bool = True

    # -- parsing -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DSparkConfig:
        """Strict parse of a draft config.json object; raises ValueError naming bad keys."""
        d = dict(raw)
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"draft config: model_type must be {MODEL_TYPE!r}, got {d['model_type']!r}")
        if d.get("every_n_layers_global") is not None and isinstance(d.get("global_attn_cfg"), list):
            raise ValueError("draft config: every_n_layers_global cannot be combined with a list global_attn_cfg")
        for k in IGNORED_KEYS:
            d.pop(k, None)
        out: dict[str, Any] = {}
        dflash = d.pop("dflash_config", None) or {}
        mask = dflash.get("mask_token_id")
        for alias in MASK_ALIASES:
            value = d.pop(alias, None)
            mask = value if mask is None else mask
        if mask is not None:
            out["mask_token_id"] = int(mask)
        for block_key in ("block_size", "dspark_block_size"):
            value = d.pop(block_key, None)
            if value is not None and "block_size" not in out:
                out["block_size"] = int(value)
        mode = d.pop("draft_position_mode", None)
        if mode is not None:
            d["use_rope"] = mode == "rope"
        for name, defaults in (("moe", MOE_KEYS), ("metap", METAP_KEYS)):
            sub = d.pop(name, None) or {}
            unknown = sorted(set(sub) - set(defaults))
            if unknown:
                raise ValueError(f"draft config: unknown key(s) in {name!r}: {unknown}")
            for k in defaults:
                if k in sub and f"{name}_{k}" in {f.name for f in fields(cls)}:
                    out[f"{name}_{k}"] = sub[k]
        aux_plus_one = d.pop("eagle_aux_hidden_state_layer_ids", None)
        aux_ids = d.pop("dspark_target_layer_ids", None) or dflash.get("target_layer_ids")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"draft config: unknown key(s) {unknown}")
        out.update(d)
        missing = [
            k
            for k in (
                "target_layer_ids",
                "target_hidden_size",
                "mask_token_id",
                "markov_rank",
                "enable_confidence_head",
            )
            if k not in out
        ]
        if out.get("enable_confidence_head") and "confidence_head_with_markov" not in out:
            missing.append("confidence_head_with_markov")
        if missing:
            raise ValueError(f"draft config: missing required key(s) {missing}")
        out["target_layer_ids"] = tuple(int(i) for i in out["target_layer_ids"])
        if aux_ids is not None and tuple(aux_ids) != out["target_layer_ids"]:
            raise ValueError(
                f"draft config: dspark/dflash target_layer_ids {aux_ids} disagree with "
                f"target_layer_ids {list(out['target_layer_ids'])}"
            )
        if aux_plus_one is not None and tuple(i - 1 for i in aux_plus_one) != out["target_layer_ids"]:
            raise ValueError("draft config: eagle_aux_hidden_state_layer_ids must be target_layer_ids + 1")
        gac = out.get("global_attn_cfg")
        if isinstance(gac, str):
            gac = None if gac == "all" else json.loads(gac)
        out["global_attn_cfg"] = None if gac is None else tuple(gac)
        cfg = cls(**out)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> DSparkConfig:
        """Parse `path` (a config.json, or a directory holding one)."""
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        with open(p, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (nested moe/metap, model_type and architectures included)."""
        d: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["MuseSparkDSparkModel"]}
        moe, metap = {}, {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.startswith("moe_"):
                moe[f.name[4:]] = v
            elif f.name.startswith("metap_"):
                metap[f.name[6:]] = v
            else:
                d[f.name] = list(v) if isinstance(v, tuple) else v
        d["moe"], d["metap"] = moe, metap
        return d

    def validate(self) -> None:
        """Reject configurations the draft cannot run (§2.1 notes, §8.6)."""

        def bad(msg: str) -> None:
            raise ValueError(f"draft config: {msg}")

        if not self.use_qk_norm:
            bad("use_qk_norm must be true (the context path always normalises K)")
        if self.non_linearity != "swiglu":
            bad(f"non_linearity {self.non_linearity!r} unsupported (only 'swiglu')")
        if self.residual_dtype not in ("bf16", "fp32"):
            bad(f"residual_dtype must be 'bf16' or 'fp32', got {self.residual_dtype!r}")
        if self.post_norm_gain_center_type not in GainCenterType.__args__:  # type: ignore[attr-defined]
            bad(f"post_norm_gain_center_type {self.post_norm_gain_center_type!r} unsupported")
        if self.num_attention_heads % self.kv_heads:
            bad("num_attention_heads must be a multiple of num_key_value_heads")
        if self.use_rope and self.head_dim % 2:
            bad("head_dim must be even with RoPE")
        if self.vocab_size <= self.mask_token_id or self.mask_token_id < 0:
            bad(f"mask_token_id {self.mask_token_id} outside vocab_size {self.vocab_size}")
        if self.markov_rank <= 0:
            bad("markov_rank must be positive")
        if (
            not self.target_layer_ids
            or min(self.target_layer_ids) < 0
            or list(self.target_layer_ids) != sorted(set(self.target_layer_ids))
        ):
            bad(f"target_layer_ids must be ascending, distinct and >= 0, got {list(self.target_layer_ids)}")
        if not 0 < self.d_vocab <= self.vocab_size:
            bad("draft_vocab_size must lie in (0, vocab_size]")

    # -- derived -----------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def d_vocab(self) -> int:
        """V_d: rows of lm_head and markov_w2."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def intermediate_size(self) -> int:
        return int(self.ffn_dim_multiplier * self.hidden_size)

    @property
    def post_eps(self) -> float:
        return self.rms_norm_eps if self.rms_post_norm_eps is None else self.rms_post_norm_eps

    @property
    def q_scale(self) -> float:
        """s_q, the extra query factor after QK-norm (§2.1)."""
        return 3.87 if self.use_sqrt_attn_scaling else 43.7840518911 / math.sqrt(self.head_dim)

    @property
    def output_multiplier(self) -> float:
        """mu (§2.1 metap)."""
        if self.metap_use_metap and self.metap_router_has_one_inf_dim:
            ratio = self.hidden_size / self.metap_base_width
            return ratio**-1.0 if self.metap_metap_mode == "mup" else ratio**-0.5
        return 1.0

    def layer_uses_rope(self, ell: int) -> bool:
        """Positional mode of the draft layer with global index ell (§4.3)."""
        n = self.every_n_layers_nope
        return self.use_rope and not (n and (self.num_hidden_layers - ell - 1) % n == 0)

    def layer_window(self, ell: int) -> int | None:
        """Sliding window of the layer with global index ell, or None for full attention."""
        if self.global_attn_cfg is None:
            return None
        cb = ell
        n = self.every_n_layers_nope
        if n:
            cb += n - (self.num_hidden_layers % n)
        w = self.global_attn_cfg[cb % len(self.global_attn_cfg)]
        return w if isinstance(w, int) and w > 0 else None

    def temperature_tuned(self, ell: int) -> bool:
        return (
            self.attn_temperature_tuning_floor_scale is not None
            and self.attn_temperature_tuning_q_scale_constant is not None
            and self.attn_temperature_tuning_layers == "global"
            and self.layer_window(ell) is None
        )

    def is_moe(self, ell: int) -> bool:
        step = self.moe_interleave_moe_layer_step
        return bool(
            self.moe_is_enabled and step > 0 and (ell + 1) % step == 0 and ell >= self.moe_n_dense_layers_before_moe
        )


def gain_center(kind: str, residual_id: int) -> float:
    """gamma(type, rid), the post-norm gain centre (§4.1)."""
    if kind == "one":
        return 1.0
    if kind == "zero":
        return 0.0
    if kind == "inverse_residual_index":
        return 1.0 / (2 * math.ceil(residual_id / 2))
    if kind in ("inverse_residual_index_v2", "inverse_residual_index_p1"):
        return 1.0 / (residual_id + 1)
    if kind == "inverse_sqrt_residual_index":
        return 1.0 / math.sqrt(2 * math.ceil(residual_id / 2))
    raise ValueError(f"gain centre type {kind!r} unsupported")
