// The row-count thresholds of the CPU plan: one table for the kernels and for Python.
//
// The kernels compile these in; `musespark.kernels.cpu.thresholds()` reads the
// `constexpr int64_t kName = N;` lines of this file (one per line, nothing else on it) for the
// Python side of the plan (backends/cpu_plan.py). Changing a number here changes both, and the
// kernels' build key (it hashes every source).
#pragma once

#include <cstdint>

namespace musespark_rows {

// Chosen by the kernels.
// Products of at most this many rows on the fp32 tiles read the weight as far-apart streams
// (gemm/avx2_tiles.h stream_rows); more take the weight in tiles, x in blocks.
constexpr int64_t kStreamMaxRows = 3;
// A weight tile's reads cost as much as this many rows of x when work is split across threads
// (gemm/jobs.cpp split_tiles, blocks/ffn_block.cpp).
constexpr int64_t kTileFixedRows = 8;
// Without batch invariance, bf16 products of at least this many rows go to oneDNN (gemm/jobs.cpp).
constexpr int64_t kOnednnMinRows = 64;
// Dot-product kernel products of up to this many rows prefetch the next weight tile (gemm/bf16_dots_avx512.cpp).
constexpr int64_t kPrefetchMaxRows = 64;
// AMX: packed-panel products of at least this many rows take rows in superblocks of this size.
constexpr int64_t kSuperRows = 256;

// Chosen by the Python plan (backends/cpu_plan.py).
// fp32 layer steps of at most this many rows take the fused blocks; more keep MKL's GEMM.
constexpr int64_t kFp32FusedMaxRows = 16;
// Weight-only NVFP4 products outside the fused blocks of at most this many rows take the
// native kernel; more decode the weight once and use the reference GEMM.
constexpr int64_t kNvfp4NativeMaxRows = 16;
// bf16 products outside the fused blocks of more rows than this are widened to fp32 on CPUs
// without bf16 hardware (below it, the bf16 GEMM's conversions cost less than widening the weight).
constexpr int64_t kBf16GemmMaxRows = 64;

}  // namespace musespark_rows
