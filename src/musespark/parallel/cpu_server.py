"""One CPU server: resident bytes, KV budget and projected speed (`musespark plan --device cpu`).

`plan_cpu_server(cfg, plan, ...)` takes the tp = pp = 1 `RankPlan` of the model (what the
checkpoint holds, parallel/plan.py) and adds what the cpu backend makes and reads:

* **Packed copies** (backends/cpu_args.py `WeightArgs`): on the kernel paths whose bf16
  products read weight panels (`kernels.cpu.PANEL_PATHS`: avx512_bf16, amx_bf16) every dense
  bf16 linear layer (attention q/k/v/output gate/o, pooler and unpooler, dense MLPs, the LM
  head) is packed once more into panels of 64 rows (`cpu.pack_panels`: ceil(N/64)·64·K·2 bytes),
  beside the checkpoint's copy. bf16 experts are packed too when `MUSESPARK_EXPERT_PANELS` is 1,
  or when it is auto (the default) and 4× their bytes fit in the memory left (`cpu.expert_panels`
  asks the free memory at start-up; the plan takes memory − resident weights for it). NVFP4
  weights are never repacked; the router stays fp32 (no copy). The avx2 path packs nothing.
* **KV budget**: memory − resident bytes, in whole blocks of full-attention tokens (sliding
  layers' caps reserved per `max_num_seqs`, as the GPU plan does).
* **Decode, batch 1** (a projection, not a measurement): a token reads every non-expert weight
  (the panel copy instead of the original where there is one: the same bytes), its top-k
  experts of every sparse layer, the LM head, one embedding row, plus `context` tokens of KV;
  tokens/s = bandwidth × efficiency / those bytes. Default efficiency 0.6: KTransformers decodes
  DeepSeek-V3 at ≈ 60% of a socket's roofline; musespark measured 50-73% on the real-width slice.
* **Prefill** (a projection): multiply-adds per token = the active parameters (no embedding;
  attention scores not counted), at a per-core rate for NVFP4 experts and another for bf16
  products. Defaults are the rates measured on the real-width 816B slice (2 cores, AVX-512-BF16):
  NVFP4 experts 10 G multiply-adds/s per core (each weight decoded to fp32, fp32 FMAs), bf16
  products 67 G/s per core.

Sockets multiply the bandwidth and cores: that assumes NUMA-aware placement (weights on the
node whose threads read them), which musespark does with one tensor-parallel rank per socket
(`-tp S`, docs/parallel.md §11); one process spread over the sockets reads across the link.
Not counted: activations and workspaces, the OS, the page cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config import ModelConfig
from .plan import GB, RankPlan

PANEL_ROWS = 64  # kernels/csrc/gemm/gemm_kernels.h kPanelRows (kernels.cpu.PANEL_ROWS)
CPU_PATHS = ("avx2", "avx512", "avx512_bf16", "amx_bf16")
PANEL_PATHS = ("avx512_bf16", "amx_bf16")  # kernels.cpu.PANEL_PATHS without the test-only emulation
DEFAULT_BANDWIDTH_PER_SOCKET = 250.0  # GB/s: a 12-channel DDR5-4800 socket's STREAM-class figure, assumed
DEFAULT_CORES_PER_SOCKET = 32
DEFAULT_EFFICIENCY = 0.6
DEFAULT_NVFP4_GMACS = 10.0  # per core, measured on the real-width slice (NVFP4 experts, several rows)
DEFAULT_BF16_GMACS = 67.0  # per core, measured on the real-width slice (bf16 products)


def panel_bytes(n: int, k: int, count: int = 1) -> int:
    """Bytes of `count` [n, k] bf16 weights packed into panels (rows padded to 64)."""
    return count * -(-n // PANEL_ROWS) * PANEL_ROWS * k * 2


@dataclass(frozen=True)
class CpuServerPlan:
    memory_bytes: int
    path: str
    sockets: int
    cores: int
    bandwidth_gbs: float
    bandwidth_assumed: bool  # True: the default per socket, not given
    efficiency: float
    weight_bytes: int  # the checkpoint's (RankPlan.weight_bytes)
    packed_bytes: dict[str, int]  # by part: dense linears, lm_head, bf16 experts
    experts_packed: bool
    kv_cache_bytes: int
    kv_tokens: int | None
    decode_bytes_per_token: int
    context: int
    decode_tokens_per_s: float
    prefill_macs_per_token: dict[str, int]  # nvfp4_experts, bf16
    nvfp4_gmacs_per_core: float
    bf16_gmacs_per_core: float
    prefill_tokens_per_s: float
    notes: tuple[str, ...] = field(default=())

    @property
    def resident_bytes(self) -> int:
        return self.weight_bytes + sum(self.packed_bytes.values())

    @property
    def fits(self) -> bool:
        return self.resident_bytes <= self.memory_bytes

    def as_dict(self) -> dict:
        out = asdict(self)
        out["notes"] = list(self.notes)
        out.update(resident_bytes=self.resident_bytes, fits=self.fits, projection=True)
        return out


def _dense_panels(cfg: ModelConfig, plan: RankPlan) -> tuple[int, int]:
    """(packed bytes of the layers' dense bf16 linears, of the LM head: packed even when tied)."""
    H, D, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    Hm = cfg.moe_hidden_size
    layers = 0
    for i in range(*plan.layers):
        layers += panel_bytes(nH * D, H, 2) + panel_bytes(nKV * D, H, 2) + panel_bytes(H, nH * D)
        if cfg.is_sparse(i):
            layers += panel_bytes(Hm, H) + panel_bytes(H, Hm)
        else:  # dense MLPs stay bf16 in the "experts" NVFP4 scope
            inter = cfg.intermediate_size
            layers += panel_bytes(inter, H, 2) + panel_bytes(H, inter)
    return layers, panel_bytes(cfg.vocab_size, H)


def plan_cpu_server(
    cfg: ModelConfig,
    plan: RankPlan,
    memory_gb: float,
    *,
    bf16_expert_layers: set[int],
    quantized: bool,
    dtype_bytes: int = 2,
    path: str = "avx512_bf16",
    sockets: int = 1,
    cores: int | None = None,
    bandwidth_gbs: float | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    context: int = 0,
    nvfp4_gmacs_per_core: float = DEFAULT_NVFP4_GMACS,
    bf16_gmacs_per_core: float = DEFAULT_BF16_GMACS,
    expert_panels: str = "auto",
    block_size: int = 16,
    max_num_seqs: int | None = None,
) -> CpuServerPlan:
    """The figures of the module docstring for one process on one CPU server. `plan`: the
    tp = pp = 1 RankPlan; `bf16_expert_layers`: the sparse layers whose experts are in the model
    dtype (all of them when not `quantized`); `expert_panels`: MUSESPARK_EXPERT_PANELS (auto, 1, 0)."""
    for name, value in (("memory", memory_gb), ("efficiency", efficiency)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if efficiency > 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    if path not in CPU_PATHS:
        raise ValueError(f"cpu path must be one of {list(CPU_PATHS)}, got {path!r}")
    if expert_panels not in ("auto", "0", "1"):
        raise ValueError(f"expert panels must be auto, 0 or 1, got {expert_panels!r}")
    for name, value, low in (("sockets", sockets, 1), ("cores", cores, 1), ("context", context, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    rates = (("bandwidth", bandwidth_gbs), ("nvfp4 rate", nvfp4_gmacs_per_core), ("bf16 rate", bf16_gmacs_per_core))
    for name, value in rates:
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    mem = int(memory_gb * GB)
    cores = cores if cores is not None else DEFAULT_CORES_PER_SOCKET * sockets
    assumed = bandwidth_gbs is None
    bandwidth = DEFAULT_BANDWIDTH_PER_SOCKET * sockets if assumed else float(bandwidth_gbs)
    E, k, Hm, Im = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.moe_hidden_size, cfg.moe_intermediate_size
    sparse = [i for i in range(*plan.layers) if cfg.is_sparse(i)]
    bf16_layers = [i for i in sparse if i in bf16_expert_layers or not quantized]
    notes: list[str] = []

    packed = {"dense_linears": 0, "lm_head": 0, "bf16_experts": 0}
    experts_packed = False
    if path in PANEL_PATHS:
        packed["dense_linears"], packed["lm_head"] = _dense_panels(cfg, plan)
        bf16_expert_bytes = len(bf16_layers) * E * 3 * Im * Hm * dtype_bytes
        expert_copy = panel_bytes(2 * Im, Hm, E * len(bf16_layers)) + panel_bytes(Hm, Im, E * len(bf16_layers))
        left = mem - plan.weight_bytes - sum(packed.values())
        experts_packed = bool(bf16_layers) and (
            expert_panels == "1" or (expert_panels == "auto" and 4 * bf16_expert_bytes <= left)
        )
        if experts_packed:
            packed["bf16_experts"] = expert_copy
        elif bf16_layers:
            notes.append(
                f"bf16 experts not packed ({expert_copy / GB:.2f} GB more if MUSESPARK_EXPERT_PANELS=1; "
                "auto packs them when 4x their bytes fit in the free memory at start-up)"
            )
    resident = plan.weight_bytes + sum(packed.values())
    if resident > mem:
        notes.append(f"weights exceed the memory ({resident / GB:.2f} > {mem / GB:.2f} GB)")
    avail = max(mem - resident - (max_num_seqs or 0) * plan.kv_bytes_per_seq_sliding, 0)
    full = plan.kv_bytes_per_token
    kv_tokens = None if full == 0 else avail // (full * block_size) * block_size

    w = plan.weights
    expert_active = w["experts"] * k // E  # every expert of a layer has the same bytes
    kv_read = context * full + min(context, plan.sliding_cap_tokens) * plan.kv_bytes_per_token_sliding
    decode_bytes = plan.weight_bytes - w["embedding"] - w["experts"] + expert_active + cfg.hidden_size * dtype_bytes
    decode_bytes += kv_read
    decode_tps = bandwidth * GB * efficiency / decode_bytes

    p = plan.params
    expert_params_per_layer = E * 3 * Im * Hm
    nvfp4_macs = (len(sparse) - len(bf16_layers)) * expert_params_per_layer * k // E
    active = p["experts"] * k // E + sum(v for part, v in p.items() if part not in ("experts", "embedding"))
    macs = {"nvfp4_experts": nvfp4_macs, "bf16": active - nvfp4_macs}
    seconds = macs["nvfp4_experts"] / (nvfp4_gmacs_per_core * 1e9 * cores) + macs["bf16"] / (
        bf16_gmacs_per_core * 1e9 * cores
    )
    if sockets > 1:
        notes.append(
            f"{sockets} sockets: bandwidth and cores counted for all of them, which assumes NUMA-aware "
            f"placement: one tensor-parallel rank per socket (-tp {sockets}); one process on them reads across the link"
        )
    if assumed:
        notes.append(
            f"bandwidth assumed {DEFAULT_BANDWIDTH_PER_SOCKET:.0f} GB/s per socket; pass --bandwidth (measured)"
        )
    return CpuServerPlan(
        memory_bytes=mem,
        path=path,
        sockets=sockets,
        cores=cores,
        bandwidth_gbs=bandwidth,
        bandwidth_assumed=assumed,
        efficiency=efficiency,
        weight_bytes=plan.weight_bytes,
        packed_bytes=packed,
        experts_packed=experts_packed,
        kv_cache_bytes=avail,
        kv_tokens=kv_tokens,
        decode_bytes_per_token=decode_bytes,
        context=context,
        decode_tokens_per_s=decode_tps,
        prefill_macs_per_token=macs,
        nvfp4_gmacs_per_core=nvfp4_gmacs_per_core,
        bf16_gmacs_per_core=bf16_gmacs_per_core,
        prefill_tokens_per_s=1.0 / seconds,
        notes=tuple(notes),
    )
