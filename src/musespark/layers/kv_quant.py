"""What the paged KV cache stores: the model's dtype, or fp8 (e4m3) at half the bytes.

`kv_cache_dtype` spellings (vLLM's): "auto" keeps keys and values in the model's dtype; "fp8"
and "fp8_e4m3" store them as `torch.float8_e4m3fn`; an explicit "bfloat16", "float16" or
"float32" must be the model's dtype (as in vLLM, where it may not differ from it).

fp8 scale scheme: one fixed scale per tensor, `FP8_KV_SCALE` = 1.0 for keys and values of
every layer (vLLM's default k_scale = v_scale = 1.0), values saturated at ±448 (e4m3's
largest finite value: e4m3fn has no infinity, and a cast need not saturate). A fixed scale costs no bytes
(the cache is exactly half a bf16 one) and no per-token work, and loses nothing a dynamic
scale would save here: e4m3 has the same relative step (2^-3) over its whole normal range
[2^-6, 448], so a scale only moves that range. Muse Spark's keys come out of a weightless
QK-norm (RMS 1, so |k| <= sqrt(head_dim)), and its values are O(1) (the bundled model's: median
|v| ~1, largest ~10), well inside the range; only values under 2^-6 lose relative precision,
and they weigh least in the products.
"""

from __future__ import annotations

import torch

from ..config import FP8_KV_SPELLINGS, check_kv_cache_dtype
from ..errors import InvalidArgumentError

FP8_KV_DTYPE = torch.float8_e4m3fn
# The CPU kernels read and write fp8 values as stored (kernels/csrc/common/simd.h load8,
# attention/decode_attention.cpp write_fp8): a scale other than 1.0 must change them too.
FP8_KV_SCALE = 1.0
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448
_DTYPE_SPELLINGS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors hold for a model computing in `model_dtype`; raises
    InvalidArgumentError for a bad value or an explicit dtype other than the model's."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FP8_KV_SPELLINGS:
        return FP8_KV_DTYPE
    dtype = _DTYPE_SPELLINGS[kv_cache_dtype]
    if dtype != model_dtype:
        name = str(model_dtype).removeprefix("torch.")
        raise InvalidArgumentError(
            f"kv_cache_dtype {kv_cache_dtype!r} must be the model's dtype ({name}); use 'auto' or 'fp8'",
            param="kv_cache_dtype",
        )
    return dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as the cache stores them: fp8 divided by the scale and saturated."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    return (x.float() / FP8_KV_SCALE).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)


def store(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write keys or values `x` [n, ...] at rows `slots` [n] of the flat cache `flat` (through a
    byte view for fp8: CPU torch has no fp8 index_copy_)."""
    if is_fp8(flat.dtype):
        flat.view(torch.uint8).index_copy_(0, slots, to_cache(x, flat.dtype).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, x.to(flat.dtype))


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys or values in the compute dtype `dtype` (fp8: times the scale)."""
    if not is_fp8(x.dtype):
        return x if x.dtype == dtype else x.to(dtype)
    return (x.to(torch.float32) * FP8_KV_SCALE).to(dtype)
