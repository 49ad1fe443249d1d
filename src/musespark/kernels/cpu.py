"""The native CPU kernels (`csrc/`, by operation), compiled on first use and cached.

The sources, one folder per operation, each holding the op and its kernels per ISA path:
  csrc/common/     the dispatch table (dispatch.h: one row per kernel path, avx2, avx512_bf16,
                   amx_emulated, amx_bf16, mapping each operation to the function that runs it),
                   CPU detection and batch invariance (isa.h), SIMD helpers, the AMX tile
                   primitives and tile state, the output buffer pool, the decoder-step entry points;
  csrc/gemm/       products with weights: the jobs and their split across threads, the AVX2 fp32
                   tiles, the AVX-512-BF16 dot and panel kernels, the AMX panel kernel, the ops
                   `linear_small_m` and `softcapped_logits`;
  csrc/attention/  paged decode attention (AVX2, AVX-512-BF16) and prompt attention
                   (AVX-512-BF16, AMX);
  csrc/nvfp4/      NVFP4 weight-only rows (AVX2, AVX-512, AVX-512-BF16) and their tables,
                   `nvfp4_linear`;
  csrc/norm/       the RMSNorm row helpers and `rms_norm`;
  csrc/blocks/     the fused decoder blocks and the one-call decode plan.
Files compiled for AVX-512 or AMX say so by a `#pragma GCC target` after their plain-C++
includes; every file shares the flags below.

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
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import env, hugepages
from ..cpu_features import cpu_flags, cpu_model, isa

logger = logging.getLogger(__name__)

# Every source and header under csrc/<operation>/ (the module docstring). torch's builder names
# each object file after its source's base name, so the base names are unique across the folders.
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*/*.cpp"))
_HEADERS = sorted(_CSRC.glob("*/*.h"))
_THRESHOLDS = _CSRC / "common" / "thresholds.h"
_LOCK = threading.Lock()
_ops: Any = None
_tried = False
_reason = ""  # why `native_ops()` returned None
_amx_reason = ""  # why an AMX CPU runs the avx512_bf16 path ("" when it does not)


def _disabled_because() -> str:
    if not env.cpu_kernels_enabled():
        return f"{env.CPU_KERNELS}=0"
    if not (platform.system() == "Linux" and platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_flags()):
        return "they need Linux on an x86-64 CPU with AVX2 and FMA"
    if isa() == "none":
        return f"{env.ISA}=none"
    return ""


def thresholds() -> dict[str, int]:
    """The CPU plan's row-count thresholds, by their C++ names (csrc/common/thresholds.h: the
    table the kernels compile in), read from the source, so both sides hold the same numbers."""
    found = re.findall(r"^constexpr int64_t (k\w+) = (\d+);", _THRESHOLDS.read_text(), re.MULTILINE)
    return {name: int(value) for name, value in found}


def kernel_path() -> str:
    """The code path the loaded native kernels run: "amx_bf16" (the avx512_bf16 path with the
    panel product on AMX tiles, on CPUs with AMX-BF16 whose tiles passed `amx_check`),
    "avx512_bf16" (vdpbf16ps products, NVFP4 weights decoded to bf16 for them, on CPUs with
    AVX-512-BF16), "avx512" (bf16 weights widened to fp32 on 16 lanes and the AVX-512 NVFP4
    decode, on CPUs with AVX-512F/BW/VL/DQ but no bf16 hardware), "avx2" (AVX2+FMA, every
    other CPU), or "none" when they are unavailable."""
    ops = native_ops()
    return "none" if ops is None else str(ops.isa_path())


def batch_invariant() -> bool:
    """Whether a request's tokens must not depend on its batch (MUSESPARK_BATCH_INVARIANT,
    default 1). 0 lets prompt-sized bf16 products use oneDNN's GEMM on AVX-512-BF16/AMX
    CPUs (kernels/csrc/common/isa.h): faster prefill; a decode row batched with a prompt may then
    round differently than alone (vLLM's batch invariance is opt-in the same way)."""
    return env.batch_invariant()


# What this process's last cpu backend chose (`expert_panels`), for the benchmarks' JSON lines.
expert_panels_chosen: bool | None = None


def expert_panels(expert_bytes: int) -> bool:
    """Whether the cpu backend packs bf16 expert weights into panels on the AVX-512-BF16 path
    (MUSESPARK_EXPERT_PANELS: 1 yes, 0 no, auto (default) when the copy, `expert_bytes` more,
    fits in a quarter of the memory available now). Packed, every expert row takes the panel
    kernel, 1.05x (batch 1) to 1.09x (48 rows) faster decode steps on Zen 4
    (benchmarks/RESULTS.md, at 965088c), at the cost of holding the experts, most of a MoE
    model, twice. Decided once per backend, so a backend's rows never change kernel."""
    global expert_panels_chosen
    value = env.expert_panels()
    if value != "auto":
        chosen = value == "1"
    else:
        try:
            chosen = 4 * expert_bytes <= os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            chosen = False
    expert_panels_chosen = chosen
    return chosen


def path_for(level: str) -> str:
    """The kernel path an ISA level (cpu_features.ISA_LEVELS) runs (amx_bf16: once its tiles
    pass `amx_check`)."""
    return level if level in ("avx512", "avx512_bf16", "amx_bf16") else "avx2"


# The paths whose bf16 products read packed weight panels (kernels/csrc/gemm/jobs.h); "amx_emulated"
# is the amx_bf16 path with the tile instructions modelled in software (tests only).
PANEL_PATHS = ("avx512_bf16", "amx_bf16", "amx_emulated")


def amx_unusable_reason() -> str:
    """Why this AMX CPU runs the avx512_bf16 path instead ("" when it does not, or is not one)."""
    return _amx_reason


PANEL_ROWS = 64  # kernels/csrc/gemm/gemm_kernels.h kPanelRows
GROUP_PAIRS = 16  # kernels/csrc/gemm/gemm_kernels.h kGroupPairs


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (K even) in the layout both panel kernels read
    (kernels/csrc/gemm/gemm_kernels.h, kernels/csrc/gemm/jobs.h `panels_arg`):
    int32 [ceil(N / 64), K / 2, 64], panel p's K / 2 * 64 words in tile order. The word of
    (pair q, column c) holds the bf16 pair (w[64p + c, 2q], w[64p + c, 2q + 1]), low half
    first, and sits at `panel_word(q, c, K // 2)`: the pairs in groups of 16 (4 KiB; the last
    may be shorter), each group as 4 blocks of 16 columns (1 KiB AMX tiles), each block pair
    after pair. Rows past N are zeros. Experts [E, N, K] give each expert's panels in turn:
    [E, ceil(N / 64), K / 2, 64]. A second copy of the weight (the same bytes), made once per
    weight."""
    if w.dtype != torch.bfloat16 or w.dim() not in (2, 3) or w.shape[-1] % 2:
        raise ValueError(
            "pack_panels: expected a bfloat16 [N, K] weight with K even (or experts' [E, N, K]), "
            f"got {w.dtype} {tuple(w.shape)}"
        )
    *lead, n, k = w.shape
    pairs = w.detach().contiguous().view(torch.int32).reshape(-1, n, k // 2)  # w[..., 2q] in the low half
    panels = -(-n // PANEL_ROWS)
    if panels * PANEL_ROWS != n:
        pairs = torch.cat([pairs, pairs.new_zeros(pairs.shape[0], panels * PANEL_ROWS - n, k // 2)], dim=1)
    out = hugepages.empty((*lead, panels, k // 2, PANEL_ROWS), torch.int32)  # streamed every step
    # [lead, panel, block b, column in block, pair] -> per group [pair in group, b, column]
    src = pairs.view(-1, panels, PANEL_ROWS // 16, 16, k // 2)
    dst = out.view(-1, panels, k // 2 * PANEL_ROWS)
    full = k // 2 // GROUP_PAIRS * GROUP_PAIRS  # pairs in whole groups
    if full:
        groups = full // GROUP_PAIRS
        dst[..., : full * PANEL_ROWS].view(-1, panels, groups, PANEL_ROWS // 16, GROUP_PAIRS, 16).copy_(
            src[..., :full].view(-1, panels, PANEL_ROWS // 16, 16, groups, GROUP_PAIRS).permute(0, 1, 4, 2, 5, 3)
        )
    if full < k // 2:  # the last, shorter group
        dst[..., full * PANEL_ROWS :].view(-1, panels, PANEL_ROWS // 16, k // 2 - full, 16).copy_(
            src[..., full:].permute(0, 1, 2, 4, 3)
        )
    return out


def panel_word(q: int, c: int, pairs: int) -> int:
    """The word of (pair q, column c) in a panel of `pairs` pairs (kernels/csrc/gemm/gemm_kernels.h)."""
    g, r = divmod(q, GROUP_PAIRS)
    gp = min(GROUP_PAIRS, pairs - g * GROUP_PAIRS)
    return g * GROUP_PAIRS * PANEL_ROWS + 16 * gp * (c // 16) + 16 * r + c % 16


def unavailable_reason() -> str:
    """Why the kernels are unavailable ("" when they are loaded or not tried yet)."""
    return _reason


# Tuples: torch's builder appends to the lists it is given (copies are passed).
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp")
# GCC only: collect its garbage from 512 MiB of heap on (the default starts at 128 MiB), about
# 10 % less compile time for the files that parse torch's headers, at ~25 % more memory per
# compiler process. GCC documents that these parameters have no effect on the code generated.
_GCC_CFLAGS = ("--param=ggc-min-heapsize=524288",)
_LDFLAGS = ("-fopenmp",)
_LIBRARY = "musespark_cpu.so"


def _compiler_version() -> tuple[str, str]:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return cxx, out


def _compiler_id() -> str:
    cxx, out = _compiler_version()
    return f"{cxx}: {out.splitlines()[0] if out else '?'}"


def _cflags() -> tuple[str, ...]:
    """_CFLAGS, and _GCC_CFLAGS when the compiler is GCC (its --version names the FSF)."""
    return _CFLAGS + (_GCC_CFLAGS if "Free Software Foundation" in _compiler_version()[1] else ())


def build_key() -> str:
    """Everything that changes the binary: kernel sources and headers (torch's builder only
    notices changes to the listed sources), flags, the compiler, and the Python and torch
    builds it links against (two environments never share, or rebuild, one cache entry)."""
    h = hashlib.sha256()
    for part in (
        *(p.read_bytes() for p in (*_SOURCES, *_HEADERS)),
        " ".join(_cflags() + _LDFLAGS).encode(),
        _compiler_id().encode(),
        sys.version.encode(),
        sys.implementation.cache_tag.encode(),
        torch.__version__.encode(),
        str(torch.version.git_version).encode(),
        torch.__file__.encode(),
        platform.machine().encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """This build's directory: `$MUSESPARK_CACHE/kernels/torch-VERSION-KEY` (see build_key)."""
    root = os.environ.get("MUSESPARK_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "musespark"
    return base / "kernels" / f"torch-{torch.__version__}-{build_key()}"


def native_ops() -> Any:
    """The `torch.ops.musespark_cpu` namespace, or None if the kernels are unavailable:
    `linear_small_m` (csrc/gemm/linear.cpp), `paged_decode_attention`
    (csrc/attention/decode_attention.cpp), `rms_norm` (csrc/norm/rms_norm.cpp) and the fused
    decoder blocks `attn_in`, `attn_out` (csrc/blocks/attn_block.cpp), `ffn_dense`, `ffn_moe`
    (csrc/blocks/ffn_block.cpp; csrc/blocks/block.h says what they share); each file states its
    contract."""
    if _tried:
        return _ops
    return _build()


def _build() -> Any:
    global _ops, _tried, _reason, _amx_reason
    with _LOCK:
        if _tried:
            return _ops
        _reason = _disabled_because()
        try:
            if not _reason:
                _ops = _compile()
                path = path_for(isa())
                if path == "amx_bf16":
                    if os.environ.get(_AMX_CHILD_ENV) == "1":  # the check's child selects the tiles itself
                        path = "avx512_bf16"
                    elif _amx_reason := amx_check():
                        path = "avx512_bf16"
                _ops.set_isa(path)
                _ops.set_batch_invariant(batch_invariant())
        except Exception as exc:  # a missing compiler or ninja, a build error: fall back, loudly
            _reason = (
                f"the build failed: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
            )
            warnings.warn(
                f"musespark: CPU kernels unavailable, using plain PyTorch ({_reason})", RuntimeWarning, stacklevel=3
            )
            _ops = None
        _tried = True
        return _ops


_AMX_CHILD_ENV = "MUSESPARK_AMX_CHECK_CHILD"
# What the build notice promises (benchmarks/RESULTS.md: about 3 minutes of CPU on a fresh 2-core machine).
BUILD_EXPECTED = "about 1-4 minutes, once per machine and torch version"
_AMX_VERDICT = "amx_check.txt"


def amx_check() -> str:
    """ "" when the AMX tiles of this CPU give the products they should, else why not.

    The AMX path cannot be tested on the machines without AMX where it was written (its
    schedule is, through a software model of the tile instructions: `set_isa("amx_emulated")`),
    so before a process uses it a child process runs it (a fault there costs the child, not
    this process) on products with partial tiles of every kind, against float64 and against
    the software model. The verdict is kept next to the library, per CPU model."""
    verdict = cache_dir() / _AMX_VERDICT
    model = cpu_model()
    try:
        kept_model, _, kept = verdict.read_text().partition("\n")
        if kept_model == model:
            return kept.strip()
    except OSError:
        pass
    env = {**os.environ, _AMX_CHILD_ENV: "1"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", "from musespark.kernels.cpu import _amx_child; _amx_child()"],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        reason = (
            ""
            if out.returncode == 0
            else (
                f"the AMX check failed (exit {out.returncode}): "
                f"{(out.stdout + out.stderr).strip().splitlines()[-1] if (out.stdout + out.stderr).strip() else '?'}"
            )
        )
    except (OSError, subprocess.SubprocessError) as exc:
        reason = f"the AMX check could not run: {type(exc).__name__}: {exc}"
    if reason:
        warnings.warn(
            f"musespark: AMX tiles unused, the avx512_bf16 path runs ({reason})", RuntimeWarning, stacklevel=4
        )
    try:  # one rename: a reader sees the whole verdict or none
        tmp = verdict.with_name(f".{verdict.name}.{os.getpid()}")
        tmp.write_text(f"{model}\n{reason}")
        os.replace(tmp, verdict)
    except OSError:
        pass
    return reason


def _amx_child() -> None:
    """The child of `amx_check`: exits non-zero (or faults) unless the hardware tiles agree."""
    ops = native_ops()
    if ops is None:
        raise SystemExit(f"no kernels: {unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 64, 32), (19, 80, 72), (40, 130, 1096), (33, 64, 2048)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        exact, panels = x.double() @ w.double().T, pack_panels(w)
        ops.set_isa("amx_bf16")
        got = [ops.linear_small_m(x, w, None, panels), ops.linear_small_m(x, w, torch.ones(m, dtype=torch.bool))]
        ops.set_isa("amx_emulated")
        ref = float((ops.linear_small_m(x, w, None, panels).double() - exact).abs().max())
        for y in got:
            err = float((y.double() - exact).abs().max())
            if not err <= 2 * ref + 1e-6 * float(exact.abs().max()):
                raise SystemExit(f"{m}x{n}x{k}: largest error {err:.3g} against the software model's {ref:.3g}")
    print("ok")


def _compile() -> Any:
    """Load the cached library, or build it in a private directory and move that into place
    with one rename: a crashed build leaves no half-written cache, and of two processes
    building at once one rename wins and both load a complete library."""
    final = cache_dir()
    start = time.perf_counter()
    if (final / _LIBRARY).is_file():
        torch.ops.load_library(str(final / _LIBRARY))
        return torch.ops.musespark_cpu
    from torch.utils.cpp_extension import load

    stems = [p.stem for p in _SOURCES]
    if len(set(stems)) != len(stems):  # one object file per base name (see _SOURCES)
        raise RuntimeError(f"kernel sources share a base name: {sorted(s for s in stems if stems.count(s) > 1)}")
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        from ..startup import BuildNotice

        with BuildNotice("the CPU kernels", BUILD_EXPECTED):
            load(
                name="musespark_cpu",
                sources=[str(p) for p in _SOURCES],
                build_directory=str(staging),
                extra_cflags=list(_cflags()),
                extra_ldflags=list(_LDFLAGS),
                is_python_module=False,
                verbose=False,
            )
        try:
            os.rename(staging, final)
        except OSError:  # another process finished first: its library is as good as ours
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("musespark CPU kernels built in %.1f s (%s)", time.perf_counter() - start, final)
    return torch.ops.musespark_cpu
