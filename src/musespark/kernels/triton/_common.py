"""Helpers shared by the Triton kernels (jit functions and launcher checks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding the nearest bf16 value (ties to even).

    The interpreter truncates when it casts fp32 to bf16; a value rounded here first is
    exactly representable, so the cast that follows (in `tl.store` to a bf16 pointer, or
    `.to(tl.bfloat16)`) is exact both interpreted and compiled."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, OUT_BF16: tl.constexpr):
    """Round fp32 `x` to the output dtype's grid when that is bf16 (fp16 casts round to
    nearest in both modes; fp32 needs nothing)."""
    if OUT_BF16:
        x = round_bf16(x)
    return x


# Triton decides at decoration (import) time whether a kernel is interpreted; so do we.
_INTERPRETED = type(round_bf16).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """Whether these kernels were defined under TRITON_INTERPRET=1 (set before their import)."""
    return _INTERPRETED


def check_device(*tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on CUDA, or on CPU with interpreted kernels."""
    for t in tensors:
        if t.device.type == "cpu" and not _INTERPRETED:
            raise ValueError(
                "Triton kernels run CPU tensors only under TRITON_INTERPRET=1, set before "
                "musespark.kernels.triton's kernels are imported"
            )


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel's `tl.dot` operands of `dtype` must be widened to fp32 first: always
    under the interpreter (its dot multiplies bf16 as raw integers)."""
    return _INTERPRETED and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot` input precision: IEEE fp32 products when operands are (or are widened to) fp32
    models' weights, the default (tensor cores) for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else None


def is_bf16(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


def pow2(n: int, least: int = 16) -> int:
    """The smallest power of two >= max(n, least) (block sizes; tl.dot wants >= 16)."""
    return max(least, triton.next_power_of_2(n))
