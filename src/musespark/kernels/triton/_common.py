"""Helpers shared by the Triton kernels (jit functions and launcher checks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting


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


def check_device(*tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on CUDA, or on CPU under TRITON_INTERPRET=1."""
    for t in tensors:
        if t.device.type == "cpu" and not interpreting():
            raise ValueError("Triton kernels run CPU tensors only under TRITON_INTERPRET=1")


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel's `tl.dot` operands of `dtype` must be widened to fp32 first: always
    under the interpreter (its dot multiplies bf16 as raw integers)."""
    return interpreting() and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot` input precision: IEEE fp32 products when operands are (or are widened to) fp32
    models' weights, the default (tensor cores) for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else None


def is_bf16(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


def pow2(n: int, least: int = 16) -> int:
    """The smallest power of two >= max(n, least) (block sizes; tl.dot wants >= 16)."""
    return max(least, triton.next_power_of_2(n))
