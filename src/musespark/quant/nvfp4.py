"""NVFP4 ("modelopt_fp4") weight formats: a linear layer and the fused 3-D experts stored as
packed E2M1 codes with fp8-e4m3 block scales and fp32 global scales (docs/nvfp4.md §2, §3),
kept packed in memory and decoded on every product (a plain-torch reference; the decoding, in
row blocks straight to the activation dtype, is `nvfp4_decode.py`'s).

Two numerics modes, one per model:
- "weight-only": each weight is decoded to fp32, rounded to the activation dtype and
  multiplied with the unquantized activations (vLLM's Hopper/Marlin W4A16 path);
- "w4a4": the activations are quantized per 16 with the static input scale first (docs/nvfp4.md
  §4) and the product is alpha * sum_k (E2M1*sf_x)(E2M1*sf_w) in fp32 with
  alpha = input_scale * weight_scale_2 (the Blackwell GEMM); the experts follow the TRT-LLM
  MoE steps (one input scale A1 = max over experts for GEMM1, A2 for GEMM2, h re-quantized).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.loader import find_weight_files
from ..checkpoint.names import TensorSpec, to_relative
from ..checkpoint.safetensors_file import SafetensorsFile
from .format import ExpertsFormat, LinearFormat
from .gemm import Gemm, linear
from .nvfp4_decode import dequantize_to, scratch
from .nvfp4_math import BLOCK, quantize_activation

MODES = ("weight-only", "w4a4")
CODES, SCALE = torch.uint8, torch.float8_e4m3fn


_ONE = torch.ones((), dtype=torch.float32)


def unscaled_weight(packed: torch.Tensor, block_scale: torch.Tensor, reuse: str | None = None) -> torch.Tensor:
    """E2M1[code] * f32(block scale) in fp32 [N, K] (the W4A4 product's weight factor), decoded in
    row blocks: the bits of `nvfp4_math.unscaled_weight`. `reuse`: into this thread's scratch
    buffer of that name (`nvfp4_decode.scratch`), for a weight the caller drops at once."""
    out = None if reuse is None else scratch(reuse, (packed.shape[0], 2 * packed.shape[1]), torch.float32)
    return dequantize_to(packed, block_scale, _ONE, torch.float32, out)


def _out(reuse: str | None, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Where to decode `packed` [N, K/2]: this thread's scratch buffer `reuse`, or None (a new tensor)."""
    return None if reuse is None else scratch(reuse, (packed.shape[0], 2 * packed.shape[1]), dtype)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"nvfp4_mode must be one of {list(MODES)}, got {mode!r}")
    return mode


def _check_k(name: str, k: int, what: str) -> None:
    if k % BLOCK:
        raise ValueError(
            f"{name}: NVFP4 needs {what} to be a multiple of {BLOCK}, got {k} (exclude this module or pad it)"
        )


class Nvfp4Linear(LinearFormat):
    """One NVFP4 linear layer [N, K] named `name` (our relative module name, for errors).
    Tensors: `weight` uint8 [N, K/2], `weight_scale` e4m3 [N, K/16], `weight_scale_2` fp32
    0-d, and `input_scale` fp32 0-d when the checkpoint has activation scales (quant_algo
    NVFP4; not W4A16_NVFP4)."""

    takes_gemm = True

    def __init__(self, name: str, mode: str = "weight-only", input_scales: bool = True) -> None:
        self.name, self.mode, self.input_scales = name, check_mode(mode), input_scales
        if mode == "w4a4" and not input_scales:
            raise ValueError(f"{name}: nvfp4_mode 'w4a4' needs input scales, and a W4A16_NVFP4 checkpoint has none")

    def tensors(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        _check_k(self.name, in_features, "in_features (K)")
        N, K = out_features, in_features
        specs = {
            "weight": TensorSpec((N, K // 2), CODES),
            "weight_scale": TensorSpec((N, K // BLOCK), SCALE),
            "weight_scale_2": TensorSpec((), torch.float32),
        }
        if self.input_scales:
            specs["input_scale"] = TensorSpec((), torch.float32)
        return specs

    def dequantized(self, module: nn.Module) -> torch.Tensor:
        """The decoded weight [N, K] in fp32."""
        return self.decoded(module, torch.float32)

    @staticmethod
    def decoded(module: nn.Module, dtype: torch.dtype, reuse: str | None = None) -> torch.Tensor:
        """The decoded weight [N, K] rounded to `dtype` (the fp32 decode, rounded once); `reuse`:
        into this thread's scratch buffer of that name, for a weight the caller drops at once."""
        w, s = module.weight, module.weight_scale
        return dequantize_to(w, s, module.weight_scale_2, dtype, _out(reuse, w, dtype))

    def apply(self, module: nn.Module, x: torch.Tensor, gemm: Gemm | None = None) -> torch.Tensor:
        if self.mode == "weight-only":
            return (gemm or linear)(x, self.decoded(module, x.dtype, reuse="linear"))
        xq, _ = quantize_activation(x, module.input_scale)
        alpha = module.input_scale.float() * module.weight_scale_2.float()
        w = unscaled_weight(module.weight, module.weight_scale, reuse="linear")
        return (F.linear(xq, w) * alpha).to(x.dtype)

    def __repr__(self) -> str:
        return f"Nvfp4Linear({self.mode})"


class Nvfp4Experts(ExpertsFormat):
    """E fused NVFP4 SwiGLU experts named `name` (docs/nvfp4.md §3): `gate_up_proj` uint8
    [E, 2I, Hm/2] (gate rows [0, I), up rows [I, 2I)), `gate_up_proj_weight_scale` e4m3
    [E, 2I, Hm/16], `gate_up_proj_weight_scale_2` fp32 [E, 2] (col 0 gate, col 1 up),
    `down_proj` uint8 [E, Hm, I/2], `down_proj_weight_scale` e4m3 [E, Hm, I/16],
    `down_proj_weight_scale_2` fp32 [E]; with input scales also `gate_up_proj_input_scale`
    fp32 [E, 2] and `down_proj_input_scale` fp32 [E]."""

    takes_gemm = True

    def __init__(self, name: str, mode: str = "weight-only", input_scales: bool = True) -> None:
        self.name, self.mode, self.input_scales = name, check_mode(mode), input_scales
        if mode == "w4a4" and not input_scales:
            raise ValueError(f"{name}: nvfp4_mode 'w4a4' needs input scales, and a W4A16_NVFP4 checkpoint has none")

    def tensors(self, num_experts: int, intermediate: int, hidden: int) -> dict[str, TensorSpec]:
        _check_k(self.name, hidden, "moe_hidden_size (gate_up_proj's K)")
        _check_k(self.name, intermediate, "moe_intermediate_size (down_proj's K)")
        E, I, Hm = num_experts, intermediate, hidden
        specs = {
            "gate_up_proj": TensorSpec((E, 2 * I, Hm // 2), CODES),
            "gate_up_proj_weight_scale": TensorSpec((E, 2 * I, Hm // BLOCK), SCALE),
            "gate_up_proj_weight_scale_2": TensorSpec((E, 2), torch.float32),
            "down_proj": TensorSpec((E, Hm, I // 2), CODES),
            "down_proj_weight_scale": TensorSpec((E, Hm, I // BLOCK), SCALE),
            "down_proj_weight_scale_2": TensorSpec((E,), torch.float32),
        }
        if self.input_scales:
            specs["gate_up_proj_input_scale"] = TensorSpec((E, 2), torch.float32)
            specs["down_proj_input_scale"] = TensorSpec((E,), torch.float32)
        return specs

    @staticmethod
    def gate_up_global(module: nn.Module, expert: int) -> torch.Tensor:
        """Expert `expert`'s per-row global scale [2I, 1]: ws2[e, 0] for gate rows, ws2[e, 1] for up rows."""
        rows = module.gate_up_proj.shape[1] // 2
        return module.gate_up_proj_weight_scale_2[expert].float().repeat_interleave(rows)[:, None]

    def dequantized(self, module: nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s decoded (gate_up [2I, Hm], down [Hm, I]) in fp32."""
        return self.decoded(module, expert, torch.float32)

    def decoded(
        self, module: nn.Module, expert: int, dtype: torch.dtype, reuse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s (gate_up [2I, Hm], down [Hm, I]), each the fp32 decode rounded once to
        `dtype`, decoded in row blocks: only this expert's weights are ever decoded, and the
        caller (`Experts`) asks once per step for each expert its tokens chose. `reuse`: into
        this thread's scratch buffers, overwritten by the next expert (the caller drops them)."""
        gu, dn = module.gate_up_proj[expert], module.down_proj[expert]
        gate_up = dequantize_to(
            gu,
            module.gate_up_proj_weight_scale[expert],
            self.gate_up_global(module, expert),
            dtype,
            _out("experts.gate_up" if reuse else None, gu, dtype),
        )
        down = dequantize_to(
            dn,
            module.down_proj_weight_scale[expert],
            module.down_proj_weight_scale_2[expert],
            dtype,
            _out("experts.down" if reuse else None, dn, dtype),
        )
        return gate_up, down

    def apply(
        self, module: nn.Module, expert: int, x: torch.Tensor, partial: bool = False, gemm: Gemm | None = None
    ) -> torch.Tensor:
        if self.mode == "weight-only":
            mm = gemm or linear
            gate_up, down = self.decoded(module, expert, x.dtype, reuse=True)
            gate, up = mm(x, gate_up).chunk(2, dim=-1)
            h = F.silu(gate) * up
            return F.linear(h.float(), down.float()) if partial else mm(h, down)
        a1 = module.gate_up_proj_input_scale.float().max()  # one activation scale for all experts
        a2 = module.down_proj_input_scale.float().max()
        xq, _ = quantize_activation(x, a1)
        ws2 = module.gate_up_proj_weight_scale_2[expert].float()
        w = unscaled_weight(module.gate_up_proj[expert], module.gate_up_proj_weight_scale[expert], "experts.gate_up")
        gu = F.linear(xq, w)
        gate, up = gu.chunk(2, dim=-1)
        h = (F.silu(gate * (a1 * ws2[0])) * (up * (a1 * ws2[1]))).to(x.dtype)  # the kernel's rounding: inferred
        hq, _ = quantize_activation(h, a2)
        w = unscaled_weight(module.down_proj[expert], module.down_proj_weight_scale[expert], "experts.down")
        y = F.linear(hq, w)
        y = y * (a2 * module.down_proj_weight_scale_2[expert].float())
        return y if partial else y.to(x.dtype)

    def __repr__(self) -> str:
        return f"Nvfp4Experts({self.mode})"


def scale_tensor_names(specs: dict[str, TensorSpec]) -> list[str]:
    """The names among `specs` (relative, any module) that are NVFP4 scales, to check for NaN/inf."""
    return [n for n, s in specs.items() if s.dtype == SCALE or n.endswith(("weight_scale_2", "input_scale"))]


# Bytes of e4m3 scales checked per step: the check reads the raw bytes in blocks through one
# reused buffer, so it never makes a wider (fp32) copy of a scale tensor (a real-width layer holds
# gigabytes of them) nor a fresh temporary per block (each would be page-faulted in and zeroed).
SCALE_CHECK_BLOCK = 1 << 22


def e4m3_has_nan(t: torch.Tensor, block: int = SCALE_CHECK_BLOCK) -> bool:
    """Whether float8_e4m3fn tensor `t` holds a NaN, read from its raw bytes: e4m3fn has no
    infinity, and its only non-finite patterns are 0x7F and 0xFF (exponent and mantissa all
    ones, either sign), so `max(byte & 0x7F) == 0x7F` is exactly `not isfinite(float(t)).all()`.
    Two passes over a cache-sized block (an AND into the buffer, its max): about 20 GB/s on two
    cores, where masking, comparing and reducing into new tensors ran at 1.4 GB/s."""
    raw = t.reshape(-1).view(torch.uint8)  # a view: no copy of a contiguous tensor
    buf = torch.empty(min(block, raw.numel()), dtype=torch.uint8)
    for start in range(0, raw.numel(), block):
        part = raw[start : start + block]
        low = torch.bitwise_and(part, 0x7F, out=buf[: part.numel()])
        if int(low.max()) == 0x7F:
            return True
    return False


def check_finite_scales(state: dict[str, torch.Tensor], names: list[str]) -> None:
    """Refuse NaN/inf (vLLM's "never loaded" sentinel is NaN) or non-positive global/input scales.
    Block scales (e4m3) are checked on their raw bytes in blocks (`e4m3_has_nan`); the global and
    input scales are small fp32 tensors, checked as floats."""
    for name in names:
        t = state[name]
        bad = e4m3_has_nan(t) if t.dtype == SCALE else not torch.isfinite(t.float()).all()
        if bad:
            raise ValueError(f"tensor {name!r}: NVFP4 scale holds NaN or inf; expected finite values")
        if name.endswith(("weight_scale_2", "input_scale")) and not (t.float() > 0).all():
            raise ValueError(f"tensor {name!r}: NVFP4 global/input scale must be > 0, got min {t.float().min().item()}")


_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def check_checkpoint_layout(path: str | Path, specs: dict[str, TensorSpec]) -> None:
    """Header-only checks of checkpoint `path` against the NVFP4 model's `specs` (relative
    names), for the mistakes whose generic loader error would not say what is wrong:
    per-expert expert tensors (`experts.<e>.gate_proj.weight`: Muse needs the fused 3-D
    layout), and a float tensor where a module that is not excluded needs packed codes."""
    for file in find_weight_files(Path(path)):
        with SafetensorsFile(file) as st:
            for disk, entry in st.entries.items():
                rel = to_relative(disk)
                if rel is None:
                    continue
                per_expert = _PER_EXPERT.match(rel)
                if per_expert and rel not in specs:
                    raise ValueError(
                        f"{file}: tensor {disk!r} is a per-expert tensor; NVFP4 experts must be stored fused, "
                        f"one 3-D set per layer: {per_expert.group(1)}.gate_up_proj uint8 [E, 2I, Hm/2], "
                        "gate_up_proj_weight_scale e4m3 [E, 2I, Hm/16], gate_up_proj_weight_scale_2 fp32 [E, 2], "
                        "down_proj uint8 [E, Hm, I/2], ... (docs/nvfp4.md §3)"
                    )
                spec = specs.get(rel)
                if spec is not None and spec.dtype == CODES and entry.dtype.is_floating_point:
                    module = rel.rsplit(".", 1)[0]
                    raise ValueError(
                        f"{file}: tensor {disk!r} is stored as {entry.dtype}, but module {module!r} is not in the "
                        f"quantization config's exclude list, so NVFP4 packed uint8 codes of shape "
                        f"{list(spec.full_shape)} (and its scales) are expected; quantize it or exclude it"
                    )
