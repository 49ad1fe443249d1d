"""The environment variables that change what computes, read here and nowhere else.

Each reader checks its value and names the variable in its error. The table `COMPUTE` lists
them for the docs (docs/cpu.md §4 shows the same list; tests/project/test_env.py checks that
the two agree and that no other module reads these names). Variables that choose where
files go or who may call the server (`MUSESPARK_CACHE`, `MUSESPARK_MODEL`,
`MUSESPARK_API_KEY`, `MUSESPARK_BENCH_CACHE`) change no number and are read where they are used.
"""

from __future__ import annotations

import os

CPU_KERNELS = "MUSESPARK_CPU_KERNELS"
ISA = "MUSESPARK_ISA"
BATCH_INVARIANT = "MUSESPARK_BATCH_INVARIANT"
EXPERT_PANELS = "MUSESPARK_EXPERT_PANELS"
HUGEPAGES = "MUSESPARK_HUGEPAGES"
TRITON_INTERPRET = "TRITON_INTERPRET"

# name -> (default, what it does)
COMPUTE: dict[str, tuple[str, str]] = {
    CPU_KERNELS: ("1", "0 disables the native CPU kernels: `auto` then picks the torch backend"),
    ISA: (
        "the CPU's",
        "run the kernels as if the CPU stopped at this level (none, avx2, avx512, avx512_bf16, amx_bf16)",
    ),
    BATCH_INVARIANT: ("1", "0 lets prompt-sized bf16 products use oneDNN on AVX-512-BF16/AMX CPUs (faster prefill)"),
    EXPERT_PANELS: ("auto", "1/0: pack bf16 experts into panels on the AVX-512-BF16 paths (auto: when the copy fits)"),
    HUGEPAGES: ("1", "0: large tensors are plain allocations, not mapped with huge-page advice"),
    TRITON_INTERPRET: ("0", "1 runs the Triton kernels in Triton's CPU interpreter"),
}


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected {', '.join(allowed[:-1])} or {allowed[-1]}")
    return value


def cpu_kernels_enabled() -> bool:
    return os.environ.get(CPU_KERNELS, "1") != "0"


def isa_override() -> str | None:
    """The ISA level MUSESPARK_ISA names, unchecked (cpu_features.isa checks it), or None."""
    return os.environ.get(ISA) or None


def batch_invariant() -> bool:
    return _choice(BATCH_INVARIANT, "1", ("0", "1")) == "1"


def expert_panels() -> str:
    """ "0", "1" or "auto"."""
    return _choice(EXPERT_PANELS, "auto", ("0", "1", "auto"))


def hugepages_enabled() -> bool:
    return os.environ.get(HUGEPAGES, "1") != "0"


def triton_interpreting() -> bool:
    return os.environ.get(TRITON_INTERPRET, "0") not in ("", "0")
