// NVFP4 weight rows on AVX2 + FMA (nvfp4/nvfp4.h; nvfp4/nvfp4_linear.cpp states the numerics).
#include "nvfp4.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "../common/simd.h"
#include "nvfp4_tables.h"

namespace musespark_nvfp4 {
namespace {

using musespark_simd::hsum;

// One block's 16 decoded weights: w0 = elements 0, 2, ..., 14 and w1 = 1, 3, ..., 15.
// permutevar8x32 reads index bits 0-2 only: a nibble's magnitude bits as they are. The table's
// entry c holds its magnitude XOR c << 28 (nvfp4_tables.h), so XORing the nibble shifted left
// by 28 (its bits 0-2 onto 28-30, its sign bit 3 onto 31) gives the magnitude back with the
// code's sign: two instructions where a mask of the sign bit took three.
inline void decode_block(const uint8_t* codes, const float* mags_of_scale, __m256& w0, __m256& w1) {
  const __m256 mags = _mm256_loadu_ps(mags_of_scale);
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i hi = _mm256_srli_epi32(lo, 4);  // bits 4-7 of a byte: the odd element's code
  // lo << 28 keeps the low nibble only (bits 4-7 leave the 32-bit lane)
  w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, lo), _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
  w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, hi), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
}

// y[n + r] for R rows from n with one row of x: per row, two 8-lane accumulators over the
// blocks in order (even and odd elements), summed at the end (the M > 1 path's sums).
constexpr int kRows = 4;

template <int R>
inline void rows_m1(const float* xp, int64_t K, const uint8_t* codes, const uint8_t* scales, const float* const* tables,
                    int64_t rows_per_global, int64_t n, float* y) {
  const int64_t nb = K / kBlock;
  const uint8_t* c[R];
  const uint8_t* s[R];
  const float* table[R];
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    c[r] = codes + (n + r) * (K / 2);
    s[r] = scales + (n + r) * nb;
    table[r] = tables[(n + r) / rows_per_global];
    acc0[r] = acc1[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 xe = _mm256_loadu_ps(xp + b * kBlock), xo = _mm256_loadu_ps(xp + b * kBlock + 8);
    for (int r = 0; r < R; ++r) {
      if ((b & 7) == 0) {  // the same line of the next R rows (nvfp4/nvfp4.h: rows_ahead)
        _mm_prefetch(reinterpret_cast<const char*>(c[r] + R * (K / 2) + b * 8), _MM_HINT_T0);
        if ((b & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(s[r] + R * nb + b), _MM_HINT_T0);
      }
      __m256 w0, w1;
      decode_block(c[r] + b * 8, table[r] + s[r][b] * 8, w0, w1);
      acc0[r] = _mm256_fmadd_ps(w0, xe, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, xo, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// The M > 1 products (a batch's rows that chose the same expert, a prompt): NR weight rows
// decoded once, kChunkBlocks blocks at a time, into the thread's scratch (L1), and every x row
// multiplied by them in register tiles of NR weight rows by MR x rows (16 registers: 12
// accumulators), FMA-bound instead of decode-bound. Each (m, n) keeps the M = 1 path's two
// accumulators, parked in `acc` between chunks: the same sums in the same order, the same
// bits whatever M.
constexpr int kNR = 2;
constexpr int kMR = 3;
constexpr int64_t kChunkBlocks = 64;  // 1024 weights per row: NR rows of decoded fp32 = 8 KiB

template <int NR, int MR>
inline void tile_chunk(const float* xp, int64_t K, int64_t b0, int64_t nb, const float* w, float* acc) {
  __m256 a0[NR][MR], a1[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      a0[r][m] = _mm256_loadu_ps(acc + (m * kNR + r) * 16);
      a1[r][m] = _mm256_loadu_ps(acc + (m * kNR + r) * 16 + 8);
    }
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < NR; ++r) {
      const __m256 w0 = _mm256_load_ps(w + (r * kChunkBlocks + b) * kBlock);
      const __m256 w1 = _mm256_load_ps(w + (r * kChunkBlocks + b) * kBlock + 8);
      for (int m = 0; m < MR; ++m) {
        a0[r][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + m * K + (b0 + b) * kBlock), a0[r][m]);
        a1[r][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + m * K + (b0 + b) * kBlock + 8), a1[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(acc + (m * kNR + r) * 16, a0[r][m]);
      _mm256_storeu_ps(acc + (m * kNR + r) * 16 + 8, a1[r][m]);
    }
}

// Weight rows [n, n + NR) against the M rows of x; w and acc: the thread's scratch.
template <int NR>
inline void rows_tiled(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                       const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n, float* y,
                       float* w, float* acc) {
  const int64_t nb = K / kBlock;
  std::fill_n(acc, M * kNR * 16, 0.f);
  for (int64_t b0 = 0; b0 < nb; b0 += kChunkBlocks) {
    const int64_t cb = std::min(kChunkBlocks, nb - b0);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* c = codes + (n + r) * (K / 2);
      const uint8_t* s = scales + (n + r) * nb;
      const float* table = tables[(n + r) / rows_per_global];
      for (int64_t b = 0; b < cb; ++b) {
        __m256 w0, w1;
        decode_block(c + (b0 + b) * 8, table + s[b0 + b] * 8, w0, w1);
        _mm256_store_ps(w + (r * kChunkBlocks + b) * kBlock, w0);
        _mm256_store_ps(w + (r * kChunkBlocks + b) * kBlock + 8, w1);
      }
    }
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR) tile_chunk<NR, kMR>(xp + m * K, K, b0, cb, w, acc + m * kNR * 16);
    if (M - m == 2) tile_chunk<NR, 2>(xp + m * K, K, b0, cb, w, acc + m * kNR * 16);
    if (M - m == 1) tile_chunk<NR, 1>(xp + m * K, K, b0, cb, w, acc + m * kNR * 16);
  }
  for (int r = 0; r < NR; ++r)
    for (int64_t m = 0; m < M; ++m) {
      const float* a = acc + (m * kNR + r) * 16;
      y[m * ldy + n + r] = hsum(_mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8)));
    }
}

}  // namespace

// Rows [n0, n1) of y (fp32 [M, *], row stride ldy) from permuted x. One row of x: decode and
// multiply in registers, four weight rows at a time. More rows: rows_tiled.
void rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
          const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  if (M == 1) {  // four rows at a time: eight independent FMA chains
    for (; n + kRows <= n1; n += kRows) rows_m1<kRows>(xp, K, codes, scales, tables, rows_per_global, n, y);
    for (; n < n1; ++n) rows_m1<1>(xp, K, codes, scales, tables, rows_per_global, n, y);
    return;
  }
  alignas(32) static thread_local float w[kNR * kChunkBlocks * kBlock];
  static thread_local std::vector<float> acc;
  if (static_cast<int64_t>(acc.size()) < M * kNR * 16) acc.resize(M * kNR * 16);
  for (; n + kNR <= n1; n += kNR) rows_tiled<kNR>(xp, M, K, codes, scales, tables, rows_per_global, ldy, n, y, w, acc.data());
  for (; n < n1; ++n) rows_tiled<1>(xp, M, K, codes, scales, tables, rows_per_global, ldy, n, y, w, acc.data());
}

}  // namespace musespark_nvfp4
