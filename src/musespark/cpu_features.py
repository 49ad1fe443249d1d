"""What the host CPU can do, read once from /proc/cpuinfo (no kernels, no torch)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without it,
    PyTorch's bf16 GEMMs convert element by element and are several times slower than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def is_x86_without_native_bf16() -> bool:
    return is_x86() and not has_native_bf16()
