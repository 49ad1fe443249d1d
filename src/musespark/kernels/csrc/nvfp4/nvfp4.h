// NVFP4 weight-only rows (nvfp4/nvfp4_linear.cpp states the numerics contract): y[m * ldy + n]
// for n in [n0, n1) from x permuted to the path's decode order (nvfp4/nvfp4_tables.h
// permute_x), codes [N, K/2], scale bytes [N, K/16], and per global scale g a magnitude table
// tables[g] (table_for); rows [g rows_per_global, (g + 1) rows_per_global) use tables[g].
// common/dispatch.h maps the paths to these. Plain C++ (common/isa.h: included by both worlds).
#pragma once
#include <cstdint>

// One row of x (decode): R weight rows at a time, each read from start to end, while the
// same places of the next R rows are prefetched (`rows_ahead`: R row lengths ahead). The rows
// of a call are contiguous, so that is one linear stream; the hardware prefetchers do not
// follow R interleaved streams a row long (2-4 KiB). Measured on Zen 4, one core, 16384 x 4096
// codes from memory: 13 -> 20 G multiply-adds/s (AVX-512-BF16 rows).
namespace musespark_nvfp4 {

// AVX2 + FMA (nvfp4/nvfp4_avx2.cpp): tables of 8 magnitudes per scale byte, x per block 8
// even then 8 odd elements; per row two 8-lane accumulators over the blocks in order.
void rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
          const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y);

}  // namespace musespark_nvfp4

namespace musespark_avx512 {

// AVX-512 (nvfp4/nvfp4_avx512.cpp): tables of 16 signed magnitudes (tables[g][byte * 16 +
// code]), x in the pairs order; two blocks per step, per row two 16-lane accumulators over
// the pairs of blocks in order.
void nvfp4_rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y);

// AVX-512-BF16 (nvfp4/nvfp4_avx512_bf16.cpp), for x holding bf16 values (the tables then hold
// bf16 values too): x as bf16 bits in the natural order, the tables of nvfp4_rows; per row one
// 16-lane vdpbf16ps accumulator over the pairs of blocks in order.
void nvfp4_rows_bf16(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                     const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1,
                     float* y);

}  // namespace musespark_avx512
