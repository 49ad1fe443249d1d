// NVFP4 weight rows on AVX2 + FMA (nvfp4/nvfp4.h; nvfp4/nvfp4_linear.cpp states the numerics).
#include "nvfp4.h"

#include <immintrin.h>

#include <vector>

#include "../common/simd.h"
#include "nvfp4_tables.h"

namespace musespark_nvfp4 {
namespace {

using musespark_simd::hsum;

// One block's 16 decoded weights: w0 = elements 0, 2, ..., 14 and w1 = 1, 3, ..., 15.
inline void decode_block(const uint8_t* codes, const float* mags_of_scale, __m256& w0, __m256& w1) {
  const __m256 mags = _mm256_loadu_ps(mags_of_scale);
  const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i even_sign = _mm256_and_si256(_mm256_slli_epi32(raw, 28), sign);  // bit 3 -> bit 31
  const __m256i odd_sign = _mm256_and_si256(_mm256_slli_epi32(raw, 24), sign);   // bit 7 -> bit 31
  // permutevar8x32 reads index bits 0-2 only: the low nibble's magnitude bits as they are.
  w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, raw), _mm256_castsi256_ps(even_sign));
  w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, _mm256_srli_epi32(raw, 4)), _mm256_castsi256_ps(odd_sign));
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
      if ((b & 7) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(c[r] + b * 8) + 1024, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s[r] + b) + 256, _MM_HINT_T0);
      }
      __m256 w0, w1;
      decode_block(c[r] + b * 8, table[r] + s[r][b] * 8, w0, w1);
      acc0[r] = _mm256_fmadd_ps(w0, xe, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, xo, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

}  // namespace

// Rows [n0, n1) of y (fp32 [M, *], row stride ldy) from permuted x. One row of x: decode and
// multiply in registers. More rows: decode each weight row once into a scratch row (L1) and run the
// same accumulation for every x row from it, four x rows at a time.
void rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
          const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  std::vector<float> scratch(M > 1 ? K : 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint8_t* s = scales + n * nb;
    const float* table = tables[n / rows_per_global];
    if (M == 1) {
      if (n + kRows <= n1) {  // four rows at a time: eight independent FMA chains
        rows_m1<kRows>(xp, K, codes, scales, tables, rows_per_global, n, y);
        n += kRows - 1;
      } else {
        rows_m1<1>(xp, K, codes, scales, tables, rows_per_global, n, y);
      }
      continue;
    }
    float* w = scratch.data();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w0, w1;
      decode_block(c + b * 8, table + s[b] * 8, w0, w1);
      _mm256_storeu_ps(w + b * kBlock, w0);
      _mm256_storeu_ps(w + b * kBlock + 8, w1);
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      __m256 a0[4], a1[4];
      for (int r = 0; r < 4; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += kBlock) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int r = 0; r < 4; ++r) {
          a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + (m + r) * K + k), a0[r]);
          a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + (m + r) * K + k + 8), a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) y[(m + r) * ldy + n] = hsum(_mm256_add_ps(a0[r], a1[r]));
    }
    for (; m < M; ++m) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += kBlock) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xp + m * K + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xp + m * K + k + 8), a1);
      }
      y[m * ldy + n] = hsum(_mm256_add_ps(a0, a1));
    }
  }
}

}  // namespace musespark_nvfp4
