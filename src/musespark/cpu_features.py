"""What the host CPU can do, read once from /proc/cpuinfo (no kernels, no torch)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from . import env

# x86 instruction-set levels the native kernels may target, lowest first.
ISA_LEVELS = ("none", "avx2", "avx512", "avx512_bf16", "amx_bf16")
# The environment that makes a process run as on an AVX2-only x86 CPU, every library alike: our
# kernels, ATen's vector kernels, oneDNN (PyTorch's bf16 matmuls then leave oneDNN for its own
# loops, as on such a CPU) and MKL. Read when each library loads: set it before torch is imported.
# Only the instruction sets change; the caches and memory stay this machine's.
AVX2_ONLY_ENV = {
    env.ISA: "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


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


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform says, or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX; lowered by
    MUSESPARK_ISA); without it, PyTorch's bf16 GEMMs convert element by element and are
    several times slower than fp32."""
    return isa() in ("avx512_bf16", "amx_bf16")


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def is_x86_without_native_bf16() -> bool:
    return is_x86() and not has_native_bf16()


@functools.cache
def detected_isa() -> str:
    """The highest ISA_LEVELS entry this CPU has (from CPUID via /proc/cpuinfo)."""
    f = cpu_flags()
    if not (is_x86() and {"avx2", "fma"} <= f):
        return "none"
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
        return "avx2"
    if "avx512_bf16" not in f:
        return "avx512"
    return "amx_bf16" if {"amx_tile", "amx_bf16"} <= f else "avx512_bf16"


def isa() -> str:
    """The ISA level the kernels may use: the detected one, or MUSESPARK_ISA if it names a
    lower level (a higher one than the CPU has is an error, not a crash later)."""
    want = env.isa_override()
    have = detected_isa()
    if not want:
        return have
    if want not in ISA_LEVELS:
        raise ValueError(f"{env.ISA}={want!r}: expected one of {', '.join(ISA_LEVELS)}")
    if ISA_LEVELS.index(want) > ISA_LEVELS.index(have):
        raise ValueError(f"{env.ISA}={want!r}: this CPU supports at most {have!r}")
    return want
