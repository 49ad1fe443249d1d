"""Write a real-width slice of Muse Spark Open 816B-A42B in the released NVFP4 layout.

The slice is a checkpoint directory musespark loads as it would the released one
(docs/nvfp4.md §1-§3, docs/parallel.md §10): `config.json` with the real text config
(fewer layers, optionally a reduced vocabulary) and `quantization_config` (form B),
`hf_quant_config.json` (form A), and safetensors shards with the exact tensor names,
shapes and dtypes: fused NVFP4 experts (uint8 codes [E, 2I, Hm/2] / [E, Hm, I/2], e4m3 block
scales, fp32 global and input scales) for every layer but the bf16-expert layers, and bf16
attention, pooler/unpooler, norms, embedding and LM head, fp32 router and residual gates.

Weights are seeded random values streamed to disk one chunk at a time: the safetensors
files are written by hand (8-byte little-endian header length, JSON header, raw data), so
no tensor is ever whole in memory and no bf16 copy of the NVFP4 experts is ever made. Peak
memory is one chunk (`CHUNK_BYTES`), whatever the widths.

Values are realistic enough that logits stay finite and routing is not degenerate:
uniformly random E2M1 codes; block scales drawn among the positive finite e4m3 values in
[128, 448] (bytes 0x70-0x7E; ModelOpt's largest block scale is 448); global scales chosen so
that each decoded matrix has rms ~ 1/sqrt(fan_in), as `init_random_weights` gives dense
matrices; input scales as a calibration with amax 8 would write them (amax / 2688).

    python tools/write_816b_slice.py DST --layers 1 --bf16-expert-layers none   # 1 NVFP4 layer, vocab 202048
    python tools/write_816b_slice.py DST --layers 2 --vocab 32768 --bf16-expert-layers 1
    python tools/write_816b_slice.py DST --hidden 256 --experts 8 ...          # a narrow slice (tests)

Without --bf16-expert-layers the released choice applies: layer 0's experts (and layer 61's in
a 62-layer slice) are bf16, 25.8 GB each at real width.

Defaults are the real widths: H 8192, 128 query / 16 KV heads of 64, 256 experts of
Hm = Im = 4096, top-8, vocab 202048. One real-width NVFP4 layer is ~7.3 GB on disk
(6.5 GB of expert codes and scales); the embedding and the LM head at the real vocabulary
are 3.3 GB each. A bf16-expert layer at real width is 25.8 GB of experts.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from musespark.checkpoint.loader import CONFIG_FILE, INDEX_FILE
from musespark.checkpoint.names import LM_HEAD, NESTED_PREFIX
from musespark.config import ModelConfig
from musespark.quant.config import HF_QUANT_CONFIG
from musespark.quant.nvfp4_math import BLOCK
from musespark.quant.quantize import config_form_a, config_form_b

CHUNK_BYTES = 64 << 20  # bytes generated and written per step: the writer's peak memory
DEFAULT_SHARD_BYTES = 5 * 10**9  # a shard closes before a tensor would take it past this (tensors are never split)
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # rms of a uniformly random code
SCALE_BYTES = (0x70, 0x7E)  # e4m3 128 .. 448: positive, finite (0x7F is NaN)
SCALE_RMS = 290.0  # about the rms of the e4m3 values in that byte range
INPUT_AMAX = 8.0  # the calibrated |x| amax the input scales stand for
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


def slice_config(
    layers: int = 1,
    vocab: int = 202048,
    hidden: int = 8192,
    heads: int = 128,
    kv_heads: int = 16,
    head_dim: int = 64,
    experts: int = 256,
    top_k: int = 8,
    moe_hidden: int = 4096,
    moe_intermediate: int = 4096,
) -> ModelConfig:
    """The 816B config (musespark.bench.presets `muse-spark-open-816b`) with `layers` decoder
    layers, all sparse, and the given widths. The layer pattern is the released one counted
    back from the last layer (the last layer is full attention), as ModelConfig's default;
    BOS/EOS ids are moved inside a reduced vocabulary."""
    special = {} if vocab > 200001 else dict(bos_token_id=1, eos_token_id=(2,))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_hidden_size=moe_hidden,
        moe_intermediate_size=moe_intermediate,
        num_local_experts=experts,
        num_experts_per_tok=min(top_k, experts),
        mlp_layer_types=("sparse",) * layers,
        layer_types=tuple(
            "full_attention" if (layers - 1 - i) % 4 == 0 else "sliding_attention" for i in range(layers)
        ),
        tie_word_embeddings=False,
        **special,
    )


@dataclass(frozen=True)
class _Tensor:
    name: str  # on-disk name
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: Callable[[int], Iterator[bytes]]  # seed -> the tensor's bytes, in chunks

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _normal(shape: tuple[int, ...], dtype: torch.dtype, std: float, mean: float = 0.0) -> Callable:
    """Chunks of mean + std * N(0, 1) in `dtype`, whole rows of the last dimension at a time."""

    def fill(seed: int) -> Iterator[bytes]:
        gen = torch.Generator().manual_seed(seed)
        row = shape[-1] if shape else 1
        rows = math.prod(shape[:-1]) if shape else 1
        step = max(1, CHUNK_BYTES // (4 * row))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            t = torch.randn(n, row, generator=gen).mul_(std).add_(mean).to(dtype)
            yield t.view(torch.uint8).numpy().tobytes()

    return fill


def _random_bytes(nbytes: int, low: int = 0, high: int = 255) -> Callable:
    """Chunks of uniformly random bytes in [low, high]."""

    def fill(seed: int) -> Iterator[bytes]:
        rng = np.random.default_rng(seed)
        for start in range(0, nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, nbytes - start)
            if (low, high) == (0, 255):
                yield rng.bytes(n)
            else:
                yield rng.integers(low, high + 1, size=n, dtype=np.uint8).tobytes()

    return fill


def _global_scales(shape: tuple[int, ...], fan_in: int) -> Callable:
    """fp32 global scales (weight_scale_2) giving decoded rms ~ 1/sqrt(fan_in), ±10% per expert;
    the columns of an [E, 2] tensor (gate, up) are equal, as ModelOpt writes them."""
    base = 1.0 / (math.sqrt(fan_in) * E2M1_RMS * SCALE_RMS)

    def fill(seed: int) -> Iterator[bytes]:
        rng = np.random.default_rng(seed)
        per_expert = base * (0.9 + 0.2 * rng.random(shape[0]))
        t = np.repeat(per_expert[:, None], shape[1], axis=1) if len(shape) == 2 else per_expert
        yield np.ascontiguousarray(t, dtype=np.float32).tobytes()

    return fill


def _constant(shape: tuple[int, ...], value: float) -> Callable:
    def fill(seed: int) -> Iterator[bytes]:
        yield np.full(shape, value, dtype=np.float32).tobytes()

    return fill


def _experts(p: str, cfg: ModelConfig, nvfp4: bool) -> list[_Tensor]:
    E, Hm, Im = cfg.num_local_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
    bf16 = torch.bfloat16
    if not nvfp4:
        return [
            _Tensor(p + "gate_up_proj", bf16, (E, 2 * Im, Hm), _normal((E, 2 * Im, Hm), bf16, Hm**-0.5)),
            _Tensor(p + "down_proj", bf16, (E, Hm, Im), _normal((E, Hm, Im), bf16, Im**-0.5)),
        ]
    for k, what in ((Hm, "moe_hidden"), (Im, "moe_intermediate")):
        if k % BLOCK:
            raise ValueError(f"NVFP4 experts need {what} to be a multiple of {BLOCK}, got {k}")
    gu_codes, gu_scales = (E, 2 * Im, Hm // 2), (E, 2 * Im, Hm // BLOCK)
    dn_codes, dn_scales = (E, Hm, Im // 2), (E, Hm, Im // BLOCK)
    u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
    return [
        _Tensor(p + "gate_up_proj", u8, gu_codes, _random_bytes(math.prod(gu_codes))),
        _Tensor(p + "gate_up_proj_weight_scale", f8, gu_scales, _random_bytes(math.prod(gu_scales), *SCALE_BYTES)),
        _Tensor(p + "gate_up_proj_weight_scale_2", f32, (E, 2), _global_scales((E, 2), Hm)),
        _Tensor(p + "gate_up_proj_input_scale", f32, (E, 2), _constant((E, 2), INPUT_AMAX / 2688)),
        _Tensor(p + "down_proj", u8, dn_codes, _random_bytes(math.prod(dn_codes))),
        _Tensor(p + "down_proj_weight_scale", f8, dn_scales, _random_bytes(math.prod(dn_scales), *SCALE_BYTES)),
        _Tensor(p + "down_proj_weight_scale_2", f32, (E,), _global_scales((E,), Im)),
        _Tensor(p + "down_proj_input_scale", f32, (E,), _constant((E,), INPUT_AMAX / 2688)),
    ]


def slice_tensors(cfg: ModelConfig, bf16_expert_layers: Sequence[int]) -> list[_Tensor]:
    """Every tensor of the checkpoint, on-disk names, in file order."""
    H, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nH, nKV, E, Hm = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts, cfg.moe_hidden_size
    bf16, f32 = torch.bfloat16, torch.float32
    pre = NESTED_PREFIX

    def dense(name: str, shape: tuple[int, ...], std: float | None = None, mean: float = 0.0, dtype=bf16) -> _Tensor:
        return _Tensor(pre + name, dtype, shape, _normal(shape, dtype, shape[-1] ** -0.5 if std is None else std, mean))

    out = [dense("embed_tokens.weight", (V, H))]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out += [
            dense(p + "input_layernorm.weight", (H,), 0.2),
            dense(p + "self_attn.q_proj.weight", (nH * D, H)),
            dense(p + "self_attn.k_proj.weight", (nKV * D, H)),
            dense(p + "self_attn.v_proj.weight", (nKV * D, H)),
            dense(p + "self_attn.gate_proj.weight", (nH * D, H)),
            dense(p + "self_attn.o_proj.weight", (H, nH * D)),
            dense(p + "post_attention_residual_gate.gate", (H,), 1.0, dtype=f32),
            dense(p + "pre_feedforward_layernorm.weight", (H,), 0.2),
            dense(p + "post_feedforward_layernorm.weight", (H,), 0.2),
            dense(p + "post_feedforward_residual_gate.gate", (H,), 1.0, dtype=f32),
            dense(p + "mlp.gate.weight", (E, H), 2.0 / H**0.5, dtype=f32),
            dense(p + "mlp.gate.e_score_correction_bias", (E,), 0.1, dtype=f32),
            dense(p + "mlp.pre_expert_proj.weight", (Hm, H)),
            dense(p + "mlp.pre_expert_norm.weight", (Hm,), 0.2),
        ]
        out += _experts(pre + p + "mlp.experts.", cfg, nvfp4=i not in bf16_expert_layers)
        out += [
            dense(p + "mlp.experts.post_expert_norm.weight", (Hm,), 0.2),
            dense(p + "mlp.post_expert_proj.weight", (H, Hm)),
        ]
    out.append(dense("norm.weight", (H,), 0.2, mean=1.0))
    out.append(_Tensor(LM_HEAD, bf16, (V, H), _normal((V, H), bf16, 3.0 / H**0.5)))
    return out


def exclude_modules(cfg: ModelConfig, bf16_expert_layers: Sequence[int]) -> list[str]:
    """The checkpoint names left unquantized (docs/nvfp4.md §3, §5.8): every attention
    projection, pooler and unpooler, the bf16-expert layers' experts, the LM head, the towers."""
    out = []
    for i in range(cfg.num_hidden_layers):
        p = f"{NESTED_PREFIX}layers.{i}."
        out += [p + f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")]
        out += [p + "mlp.pre_expert_proj"]
        if i in bf16_expert_layers:
            out.append(p + "mlp.experts*")
        out += [p + "mlp.post_expert_proj"]
    return out + ["lm_head", "model.vision_tower*", "model.audio_tower*"]


def _write_safetensors(path: Path, tensors: list[_Tensor], seed: int, progress: Callable[[int], None]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        span = [offset, offset + t.nbytes]
        header[t.name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": span}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            written = 0
            for chunk in t.fill(seed ^ zlib.crc32(t.name.encode())):
                f.write(chunk)
                written += len(chunk)
                progress(len(chunk))
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")


def write_slice(
    dst: str | Path,
    layers: int = 1,
    vocab: int = 202048,
    bf16_expert_layers: Sequence[int] | None = None,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    log: Callable[[str], None] | None = None,
    **widths: int,
) -> dict:
    """Write the slice to `dst` (created; must not hold a checkpoint already) and return a summary
    {"path", "bytes", "files", "bf16_expert_layers", "seconds"}.

    `bf16_expert_layers`: the slice layers whose experts stay bf16 (listed in the exclude list).
    None: the released choice, layers 0 and 61, where the slice has them (a slice of fewer than
    62 layers keeps layer 0's experts in bf16: pass [] for an all-NVFP4 slice). `widths`: the
    keyword arguments of `slice_config` (hidden, heads, kv_heads, head_dim, experts, top_k,
    moe_hidden, moe_intermediate); their defaults are the real widths.
    """
    cfg = slice_config(layers, vocab, **widths)
    if bf16_expert_layers is None:
        bf16_expert_layers = [i for i in (0, 61) if i < layers]
    bad = [i for i in bf16_expert_layers if not 0 <= i < layers]
    if bad:
        raise ValueError(f"bf16_expert_layers must lie in [0, {layers}), got {bad}")
    dst = Path(dst)
    if (dst / CONFIG_FILE).exists():
        raise ValueError(f"{dst} already holds a checkpoint ({CONFIG_FILE}); choose an empty directory")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = slice_tensors(cfg, set(bf16_expert_layers))
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    total = sum(t.nbytes for t in tensors)
    if log is not None:
        where = list(bf16_expert_layers) or "none"
        log(f"writing {total / 1e9:.2f} GB in {len(shards)} file(s) to {dst}; bf16 experts in layers: {where}")
    done, last, start = 0, 0.0, time.monotonic()

    def progress(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if log is not None and (now - last > 5 or done == total):
            last = now
            log(f"{done / 1e9:.2f} / {total / 1e9:.2f} GB written ({done / max(now - start, 1e-9) / 1e9:.2f} GB/s)")

    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for fname, shard in zip(names, shards):
        _write_safetensors(dst / fname, shard, seed, progress)
    if len(shards) > 1:
        weight_map = {t.name: fname for fname, shard in zip(names, shards) for t in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2))
    exclude = exclude_modules(cfg, bf16_expert_layers)
    config = cfg.to_dict(nested=True)
    config["dtype"] = config["text_config"]["dtype"] = "bfloat16"
    config["quantization_config"] = config_form_b(exclude)
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (dst / HF_QUANT_CONFIG).write_text(json.dumps(config_form_a(exclude), indent=2))
    return {
        "path": str(dst),
        "bytes": total,
        "files": names,
        "bf16_expert_layers": sorted(bf16_expert_layers),
        "seconds": time.monotonic() - start,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dst", help="output directory (created; must not hold a checkpoint)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=202048, help="202048 (real) or a reduced vocabulary")
    ap.add_argument(
        "--bf16-expert-layers",
        default=None,
        metavar="I,J",
        help="slice layers whose experts stay bf16 (comma-separated; 'none' for all NVFP4; "
        "default: layers 0 and 61 where the slice has them, as released)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9)
    for flag, default in (
        ("hidden", 8192),
        ("heads", 128),
        ("kv-heads", 16),
        ("head-dim", 64),
        ("experts", 256),
        ("top-k", 8),
        ("moe-hidden", 4096),
        ("moe-intermediate", 4096),
    ):
        ap.add_argument(f"--{flag}", type=int, default=default)
    a = ap.parse_args(argv)
    layers = None
    if a.bf16_expert_layers is not None:
        layers = [] if a.bf16_expert_layers in ("", "none") else [int(x) for x in a.bf16_expert_layers.split(",")]
    summary = write_slice(
        a.dst,
        layers=a.layers,
        vocab=a.vocab,
        bf16_expert_layers=layers,
        seed=a.seed,
        max_shard_bytes=int(a.max_shard_gb * 1e9),
        log=lambda m: print(m, file=sys.stderr, flush=True),
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        experts=a.experts,
        top_k=a.top_k,
        moe_hidden=a.moe_hidden,
        moe_intermediate=a.moe_intermediate,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
