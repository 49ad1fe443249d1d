"""The native CPU kernels (`cpu_*.cpp`, `cpu_*.h`), compiled on first use and cached.

Built with PyTorch's extension builder (the system C++ compiler and ninja) into
`$MUSESPARK_CACHE/kernels` (default `~/.cache/musespark/kernels`); later processes load
the cached library in well under a second. `python -m musespark.kernels` builds it
ahead of time (the Makefile does). Set `MUSESPARK_CPU_KERNELS=0` to disable them.

Nothing here is required: on a machine without AVX2/FMA, without a compiler, or when
the build fails (a warning says why), `native_ops()` returns None and the engine picks
the torch backend. Only `backends/cpu_backend.py` calls these ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..cpu_features import cpu_flags

logger = logging.getLogger(__name__)

_HEADERS = [Path(__file__).with_name(n) for n in ("cpu_simd.h", "cpu_gemv.h", "cpu_rows.h", "cpu_block.h")]
_SOURCES = [Path(__file__).with_name(n)
            for n in ("cpu_linear.cpp", "cpu_attention.cpp", "cpu_norm.cpp", "cpu_attn_block.cpp", "cpu_ffn_block.cpp")]
_LOCK = threading.Lock()
_ops: Any = None
_tried = False
_reason = ""  # why `native_ops()` returned None


def _disabled_because() -> str:
    if os.environ.get("MUSESPARK_CPU_KERNELS", "1") == "0":
        return "MUSESPARK_CPU_KERNELS=0"
    if not (platform.system() == "Linux" and platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_flags()):
        return "they need Linux on an x86-64 CPU with AVX2 and FMA"
    return ""


def unavailable_reason() -> str:
    """Why the kernels are unavailable ("" when they are loaded or not tried yet)."""
    return _reason


def cache_dir() -> Path:
    """One build directory per torch version and kernel source text (headers included:
    torch's builder only notices changes to the listed sources)."""
    root = os.environ.get("MUSESPARK_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "musespark"
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))).hexdigest()[:12]
    return base / "kernels" / f"torch-{torch.__version__}-{digest}"


def native_ops() -> Any:
    """The `torch.ops.musespark_cpu` namespace, or None if the kernels are unavailable:
    `linear_small_m` (cpu_linear.cpp), `paged_decode_attention` (cpu_attention.cpp),
    `rms_norm` (cpu_norm.cpp) and the fused decoder blocks `attn_in`, `attn_out`
    (cpu_attn_block.cpp), `ffn_dense`, `ffn_moe` (cpu_ffn_block.cpp; cpu_block.h says what
    they share); each file states its contract."""
    if _tried:
        return _ops
    return _build()


def _build() -> Any:
    global _ops, _tried, _reason
    with _LOCK:
        if _tried:
            return _ops
        _reason = _disabled_because()
        try:
            if not _reason:
                _ops = _compile()
        except Exception as exc:  # a missing compiler or ninja, a build error: fall back, loudly
            _reason = (f"the build failed: {type(exc).__name__}: "
                       f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}")
            warnings.warn(f"musespark: CPU kernels unavailable, using plain PyTorch ({_reason})", RuntimeWarning,
                          stacklevel=3)
            _ops = None
        _tried = True
        return _ops


def _compile() -> Any:
    from torch.utils.cpp_extension import load

    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load(name="musespark_cpu", sources=[str(p) for p in _SOURCES], build_directory=str(build_dir),
         extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    logger.info("musespark CPU kernels ready in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return torch.ops.musespark_cpu

