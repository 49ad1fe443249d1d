"""Freed activation buffers kept in the process heap (glibc malloc), for prompt-sized steps.

Why: a prompt step allocates and frees megabytes of activations per layer (the new stream,
q/k/v and the gate, the attention output). By default glibc serves a block above its mmap
threshold (128 KiB, raised as such blocks are freed) from a fresh mapping, and hands the
free top of the heap back to the kernel once it exceeds the trim threshold; either way the
next step faults those pages in and the kernel zeroes them again. On the Xeon measured a
2048-token prompt took ~14,000 page faults (53 MiB of 4 KiB pages) and ran 1.06x faster
without them (benchmarks/RESULTS.md, session 25).

`keep_freed_memory()` (called when the CPU backend is made) sets glibc's M_MMAP_THRESHOLD to
32 MiB (its largest: bigger blocks are still mapped and unmapped) and M_TRIM_THRESHOLD to
256 MiB, so the blocks of a step are reused by the next one. Cost: the process keeps up to
256 MiB of freed heap (a prompt step's activations are well under that: a 2048-token prompt
of a 1024-wide model frees about 40 MiB per layer). Process-wide, once; `MUSESPARK_KEEP_HEAP=0`
leaves malloc as it is. Without glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV = "MUSESPARK_KEEP_HEAP"
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (HEAP_MAX / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_state: str | None = None


def keep_freed_memory() -> str:
    """Applies the settings once per process; returns what `describe` reports."""
    global _state
    if _state is None:
        _state = _apply()
    return _state


def describe() -> str:
    """"on (...)", "off (MUSESPARK_KEEP_HEAP=0)", "unavailable (...)" or "not applied yet"."""
    return _state if _state is not None else "not applied yet"


def _apply() -> str:
    if os.environ.get(ENV, "1") == "0":
        return f"off ({ENV}=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "unavailable (not glibc)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as e:
        return f"unavailable ({e})"
    if not ok:
        return "unavailable (mallopt refused)"
    return f"on (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB)"
