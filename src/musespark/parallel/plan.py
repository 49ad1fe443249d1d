"""Per-rank memory of a parallel deployment, from the config alone (`musespark plan`).

`plan_memory(cfg, tp, ep, pp, quantization, ...)` returns one `RankPlan` per (pipeline
stage, tensor-parallel rank): the bytes of every weight the rank holds, by part, and its KV
cache bytes per token. It is the single source of truth for "what should rank r hold";
a sharded engine's resident bytes are meant to be checked against it.

Layout (vLLM 0.33.0, docs/parallel.md §0, §1, §4, §6, §8; DP = 1):
  * Global rank = pp_rank * tp + tp_rank (TP innermost). The EP group is the TP group of a
    stage, so ep_size = tp when expert parallelism is on, else 1.
  * Attention: q and the output gate hold nH/tp heads, k and v nKV/tp heads (no KV
    replication: nKV % tp == 0 is required), o_proj the matching nH/tp·D input columns.
  * Dense MLP layers: gate/up rows and down columns split I/tp.
  * Routed experts: with EP, a contiguous block of E//ep experts per rank, the remainder
    one each to the lowest ranks (vLLM's "linear" expert map), every expert at full width;
    without EP, all E experts on every rank at Im/tp width (Im % tp == 0 required).
  * Router weight [E,H] and e_score_correction_bias [E]: fp32, replicated.
  * Pooler (pre_expert_proj) and unpooler (post_expert_proj): replicated, always in the
    model dtype (never NVFP4).
  * Norm weights (model dtype) and residual gates (fp32): replicated. The final norm is
    counted here too (last stage only).
  * embed_tokens and lm_head: vocab-parallel, ceil(V/tp) rows per rank (for Muse, V is a
    multiple of 64·tp, so vLLM's padding to 64 adds nothing). The embedding lives on the
    first stage (and on the last one too when embeddings are tied, where lm_head reuses it);
    an untied lm_head lives on the last stage.
  * Pipeline stages split the layers as vLLM's `get_pp_indices` does (no
    VLLM_PP_LAYER_PARTITION override): L // pp each, the remainder one layer each to the
    stages counted back from the second-to-last. 62 layers: PP2 [31, 31], PP4 [15, 16, 16, 15].

NVFP4 (`quantization="nvfp4"`, docs/nvfp4.md §2-§3): a quantized linear of logical
shape [N, K] holds N·K/2 bytes of packed e2m1 codes plus N·K/16 e4m3 block scales
(0.5625 B/param; each rank's K must be a multiple of 16) and fp32 global/input scales. The
default scope ("experts") quantizes the routed experts of every sparse layer except the
first and last layer of the model (layers 0 and L-1 stay in the model dtype, as in Muse's
released checkpoint, docs/parallel.md §10); experts hold 6 fp32 scales each (gate_up
weight_scale_2 and input_scale [E,2], down weight_scale_2 and input_scale [E]), for every
expert the rank holds (all E without EP). Attention stays unquantized (docs/nvfp4.md §3: the
NVIDIA loader cannot permute NVFP4 Q/K rows), as do pooler/unpooler, router, norms,
gates, embedding and lm_head. Scope "experts+dense" also quantizes dense-MLP layers'
gate/up/down (NVFP4 unless excluded in docs/nvfp4.md; two fp32 scalars per linear).

KV cache (docs/parallel.md §4, §10): each layer of the stage stores 2·(nKV/tp)·D values per token
at the KV dtype. Full-attention layers grow with every token (`kv_bytes_per_token`);
sliding-window layers hold at most `sliding_cap_tokens` = min(sliding_window, max_model_len)
tokens per sequence, rounded up to whole blocks (`kv_bytes_per_seq_sliding`).

With `device_memory_gb` (GB = 1e9 bytes, the unit of docs/parallel.md §10's table):
`kv_cache_bytes` = device memory − weights; `kv_tokens` = the full-attention tokens that fit,
rounded down to whole blocks. Simplification: the sliding layers' per-sequence caps are
reserved only for `max_num_seqs` sequences when it is given (else nothing is reserved), and
with `max_model_len`, `max_seqs_at_max_len` counts the sequences of that length that fit
(each one's full-layer tokens plus its sliding cap).

Not counted: activations and workspaces, the CUDA context, buffers derived after loading
(residual-gate alpha/beta, fp32 norm gains, RoPE frequencies: a few KB per layer), and
vLLM's post-load repacking of NVFP4 scales (padding to 128 rows). Everything a checkpoint
holds for the rank's slice is counted, so at tp = pp = 1 the total equals the checkpoint's
text-decoder bytes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field

from ..config import ModelConfig

GB = 1e9  # docs/parallel.md §10's unit

# Weight parts, in display order.
PARTS = (
    "attention",
    "dense_mlp",
    "pooler_unpooler",
    "router",
    "router_bias",
    "experts",
    "norms_gates",
    "embedding",
    "lm_head",
)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
QUANTIZATIONS = ("nvfp4",)
NVFP4_SCOPES = ("experts", "experts+dense")
NVFP4_GROUP = 16  # elements per e4m3 block scale
FP32 = 4


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds. Byte figures are exact integers; `gb()` rounds for display."""

    rank: int  # global rank: pp_rank * tp + tp_rank
    pp_rank: int
    tp_rank: int
    layers: tuple[int, int]  # [start, end) of the decoder layers this stage runs
    experts: tuple[int, int]  # [start, end) of the global experts held in each sparse layer
    expert_width: int  # moe_intermediate_size columns held per expert (Im, or Im/tp without EP)
    weights: dict[str, int]  # bytes by part (PARTS)
    params: dict[str, int]  # logical parameters by part (NVFP4 codes count as one parameter each)
    experts_quantized_bytes: int  # the NVFP4 part of weights["experts"] (codes + scales)
    kv_dtype_bytes: int
    kv_bytes_per_token: int  # full-attention layers of the stage, per token
    kv_bytes_per_token_sliding: int  # sliding layers of the stage, per token up to the cap
    sliding_cap_tokens: int  # tokens a sliding layer holds per sequence at most (whole blocks)
    kv_bytes_per_seq_sliding: int  # = kv_bytes_per_token_sliding * sliding_cap_tokens
    device_memory_bytes: int | None = None
    kv_cache_bytes: int | None = None  # device memory - weights (- reserved sliding caps)
    kv_tokens: int | None = None  # full-attention tokens that fit (None: no full layer here)
    max_seqs_at_max_len: int | None = None  # sequences of max_model_len that fit
    notes: tuple[str, ...] = field(default=())

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def num_params(self) -> int:
        return sum(self.params.values())

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory_bytes is None else self.weight_bytes <= self.device_memory_bytes

    def gb(self, part: str | None = None) -> float:
        """A part's bytes (or the total) in GB (1e9 bytes)."""
        return (self.weight_bytes if part is None else self.weights[part]) / GB

    def as_dict(self) -> dict:
        out = asdict(self)
        out["layers"], out["experts"] = list(self.layers), list(self.experts)
        out["notes"] = list(self.notes)
        out["weight_bytes"] = self.weight_bytes
        out["num_params"] = self.num_params
        out["fits"] = self.fits
        return out


def dtype_bytes(dtype: str, cfg: ModelConfig | None = None) -> tuple[str, int]:
    """'bf16' / 'bfloat16' / 'auto' (the checkpoint's declared dtype, else bfloat16) -> (name, bytes)."""
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        declared = str(cfg.checkpoint_dtype).removeprefix("torch.") if cfg is not None and cfg.checkpoint_dtype else ""
        name = declared if _DTYPE_ALIASES.get(declared, declared) in DTYPE_BYTES else "bfloat16"
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name, DTYPE_BYTES[name]


def pp_layer_split(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's `get_pp_indices` (distributed/utils.py) splits them."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds num_hidden_layers={num_layers}: every stage needs at least one layer"
        )
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def pp_indices(num_layers: int, pp_rank: int, pp: int) -> tuple[int, int]:
    """[start, end) of stage `pp_rank`'s layers (vLLM's `get_pp_indices`)."""
    parts = pp_layer_split(num_layers, pp)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """[start, end) of the global experts EP rank `ep_rank` owns: a contiguous block of
    E // ep, the remainder one each to the lowest ranks (vLLM's linear expert map)."""
    if num_experts < ep_size:
        raise ValueError(
            f"expert parallelism over {ep_size} ranks needs num_local_experts >= {ep_size}, "
            f"got {num_experts} (ep size = tensor_parallel_size with DP=1)"
        )
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + base + (1 if ep_rank < rem else 0)


def _nvfp4_bytes(n: int, k: int, what: str) -> int:
    """Packed e2m1 codes + e4m3 block scales of one [n, k] NVFP4 matrix."""
    if k % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs each rank's input width to be a multiple of {NVFP4_GROUP}; {what} has {k}")
    return n * k // 2 + n * k // NVFP4_GROUP


def _check(cfg: ModelConfig, tp: int, ep: bool, pp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    pp_layer_split(cfg.num_hidden_layers, pp)
    if cfg.num_key_value_heads % tp:
        ok = [t for t in range(1, cfg.num_key_value_heads + 1) if cfg.num_key_value_heads % t == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_key_value_heads={cfg.num_key_value_heads}: the fused "
            f"QKV/output-gate projection shards KV heads without replication; choose one of {ok}"
        )
    sparse = any(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    dense = not all(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    if dense and cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide intermediate_size={cfg.intermediate_size} "
            "(dense MLP layers are split along it)"
        )
    if sparse and ep:
        expert_range(cfg.num_local_experts, 0, tp)
    elif sparse and cfg.moe_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide moe_intermediate_size={cfg.moe_intermediate_size} "
            "(without expert parallelism every expert is split along it); or enable expert parallelism"
        )


def plan_memory(
    cfg: ModelConfig,
    tp: int = 1,
    ep: bool = False,
    pp: int = 1,
    quantization: str | None = None,
    dtype: str = "bfloat16",
    block_size: int = 16,
    device_memory_gb: float | None = None,
    max_model_len: int | None = None,
    *,
    max_num_seqs: int | None = None,
    kv_cache_dtype: str = "auto",
    nvfp4_scope: str = "experts",
    bf16_expert_layers: Collection[int] | None = None,
) -> list[RankPlan]:
    """One `RankPlan` per (pp stage, tp rank), in global-rank order (see the module docstring).

    `ep`: vLLM's --enable-expert-parallel (EP size = tp). `quantization`: None or "nvfp4".
    `dtype`: the unquantized weights' dtype ('auto': the checkpoint's). `kv_cache_dtype`:
    'auto' (= dtype), a dtype name or 'fp8'. `device_memory_gb`: per-device memory in GB
    (1e9 bytes), to size the KV cache. `bf16_expert_layers`: with NVFP4, the layers whose experts
    stay in the model dtype (None: the first and the last, as released; a checkpoint's exclude list
    says which, `quant.config.checkpoint_quantization`).
    """
    _check(cfg, tp, ep, pp)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if nvfp4_scope not in NVFP4_SCOPES:
        raise ValueError(f"nvfp4_scope must be one of {list(NVFP4_SCOPES)}, got {nvfp4_scope!r}")
    for name, value in (("block_size", block_size), ("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if device_memory_gb is not None and not device_memory_gb > 0:
        raise ValueError(f"device memory must be a positive number of GB, got {device_memory_gb!r}")
    _, b = dtype_bytes(dtype, cfg)
    kv_name = _DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if kv_name == "auto":
        kvb = b
    elif kv_name in KV_DTYPE_BYTES:
        kvb = KV_DTYPE_BYTES[kv_name]
    else:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_DTYPE_BYTES)}, got {kv_cache_dtype!r}")

    L, H, V, D = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nH, nKV = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
    E, Hm, I = cfg.num_local_experts, cfg.moe_hidden_size, cfg.intermediate_size // tp
    ep_size = tp if ep else 1
    Im = cfg.moe_intermediate_size // (1 if ep else tp)
    v_rows = -(-V // tp)
    nvfp4 = quantization == "nvfp4"
    bf16_expert_layers = {0, L - 1} if bf16_expert_layers is None else set(bf16_expert_layers)

    plans: list[RankPlan] = []
    for pp_rank in range(pp):
        start, end = pp_indices(L, pp_rank, pp)
        first, last = pp_rank == 0, pp_rank == pp - 1
        for tp_rank in range(tp):
            e0, e1 = expert_range(E, tp_rank, ep_size) if ep else (0, E)
            n_exp = e1 - e0
            w = dict.fromkeys(PARTS, 0)
            p = dict.fromkeys(PARTS, 0)
            quantized = 0
            full = sliding = 0
            for i in range(start, end):
                attn = (2 * nH * D + 2 * nKV * D) * H + H * nH * D  # q, gate, k, v, o
                p["attention"] += attn
                w["attention"] += attn * b
                p["norms_gates"] += 5 * H
                w["norms_gates"] += 3 * H * b + 2 * H * FP32  # 3 norms, 2 fp32 residual gates
                per_token = 2 * nKV * D * kvb
                if cfg.is_sliding(i):
                    sliding += per_token
                else:
                    full += per_token
                if not cfg.is_sparse(i):
                    n = 3 * I * H
                    p["dense_mlp"] += n
                    if nvfp4 and nvfp4_scope == "experts+dense":
                        w["dense_mlp"] += (
                            2 * _nvfp4_bytes(I, H, "a dense gate/up_proj")
                            + _nvfp4_bytes(H, I, "a dense down_proj (I/tp)")
                            + 3 * 2 * FP32
                        )
                    else:
                        w["dense_mlp"] += n * b
                    continue
                p["router"] += E * H
                w["router"] += E * H * FP32
                p["router_bias"] += E
                w["router_bias"] += E * FP32
                p["pooler_unpooler"] += 2 * Hm * H
                w["pooler_unpooler"] += 2 * Hm * H * b
                p["norms_gates"] += 2 * Hm
                w["norms_gates"] += 2 * Hm * b  # pre_expert_norm, post_expert_norm
                p["experts"] += n_exp * 3 * Im * Hm
                if nvfp4 and i not in bf16_expert_layers:
                    q = n_exp * (
                        _nvfp4_bytes(2 * Im, Hm, "experts.gate_up_proj (moe_hidden_size)")
                        + _nvfp4_bytes(Hm, Im, "experts.down_proj (moe_intermediate_size per rank)")
                        + 6 * FP32
                    )
                    w["experts"] += q
                    quantized += q
                else:
                    w["experts"] += n_exp * 3 * Im * Hm * b
            if last:
                p["norms_gates"] += H
                w["norms_gates"] += H * b  # the final norm
            if first or (last and cfg.tie_word_embeddings):
                p["embedding"] += v_rows * H
                w["embedding"] += v_rows * H * b
            if last and not cfg.tie_word_embeddings:
                p["lm_head"] += v_rows * H
                w["lm_head"] += v_rows * H * b

            cap = min(cfg.sliding_window, max_model_len or cfg.sliding_window)
            cap = -(-cap // block_size) * block_size
            kv = dict(
                kv_dtype_bytes=kvb,
                kv_bytes_per_token=full,
                kv_bytes_per_token_sliding=sliding,
                sliding_cap_tokens=cap,
                kv_bytes_per_seq_sliding=sliding * cap,
            )
            notes: list[str] = []
            if device_memory_gb is not None:
                mem = int(device_memory_gb * GB)
                avail = mem - sum(w.values())
                if max_num_seqs is not None:
                    avail -= max_num_seqs * sliding * cap
                avail = max(avail, 0)
                tokens = None if full == 0 else avail // (full * block_size) * block_size
                seqs = None
                if max_model_len is not None:
                    seq_tokens = -(-max_model_len // block_size) * block_size
                    per_seq = full * seq_tokens + sliding * cap
                    seqs = avail // per_seq if per_seq else None
                if sum(w.values()) > mem:
                    notes.append(f"weights exceed the device memory ({sum(w.values()) / GB:.2f} > {mem / GB:.2f} GB)")
                kv.update(device_memory_bytes=mem, kv_cache_bytes=avail, kv_tokens=tokens, max_seqs_at_max_len=seqs)
            plans.append(
                RankPlan(
                    rank=pp_rank * tp + tp_rank,
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    layers=(start, end),
                    experts=(e0, e1),
                    expert_width=Im,
                    weights=w,
                    params=p,
                    experts_quantized_bytes=quantized,
                    notes=tuple(notes),
                    **kv,
                )
            )
    return plans


def total_params(cfg: ModelConfig) -> int:
    """Every text parameter of a tp=1 checkpoint (tied embeddings counted once)."""
    return plan_memory(cfg)[0].num_params


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of the decoder layers alone (no embedding, final norm or lm_head)."""
    p = plan_memory(cfg)[0].params
    return sum(p.values()) - p["embedding"] - p["lm_head"] - cfg.hidden_size


__all__ = [
    "GB",
    "PARTS",
    "RankPlan",
    "dtype_bytes",
    "expert_range",
    "layer_params",
    "plan_memory",
    "pp_indices",
    "pp_layer_split",
    "total_params",
]
