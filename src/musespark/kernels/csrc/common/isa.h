// What this CPU can run, and batch invariance: the process-wide settings the kernels read.
//
// The kernel paths (common/dispatch.h) and the CPU each needs: avx2 (AVX2 + FMA, every
// supported CPU), avx512_bf16 (AVX-512 F/BW/VL/DQ + BF16), amx_bf16 (that, and AMX-TILE and
// AMX-BF16 with the OS's tile state and this process's permission), amx_emulated (the
// amx_bf16 path with a software model of the tile instructions: tests on AVX-512-BF16 CPUs).
// The Python side picks the path once at load (`set_isa`, from cpu_features.isa(): CPUID
// lowered by MUSESPARK_ISA); `set_isa` refuses a path the CPU cannot run, so no path here can
// raise SIGILL.
//
// Included by both worlds (the AVX2 files and those compiled for AVX-512 by a `#pragma GCC
// target`), so it declares plain-C++ signatures only (no ATen: an inline ATen function
// instantiated in an AVX-512 file could be picked by the linker for the AVX2 world).
#pragma once
#include <cstdint>

namespace musespark_isa {

// Whether this CPU (and OS) can run the kernel path `path` (musespark_dispatch::Path).
bool cpu_runs(int path);

// Batch invariance (default on): every product computes each row the same way whatever
// the batch. Off, prompt-sized bf16 products on AVX-512-BF16/AMX CPUs use oneDNN's GEMM
// (faster, but a row's sums then depend on how many rows share the product).
bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace musespark_isa
