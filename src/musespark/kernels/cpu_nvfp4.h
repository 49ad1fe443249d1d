// NVFP4 weight-only decoding shared by the products of cpu_gemv.h (an NVFP4 `Job`) and the
// `nvfp4_linear` op (cpu_nvfp4.cpp, which states the numerics contract).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace musespark_nvfp4 {

using musespark_simd::hsum;

constexpr int64_t kBlock = 16;

// The 256 e4m3fn bytes as fp32 (exact): bias 7, subnormals m * 2^-9, 0x7F / 0xFF NaN.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float x = (e == 15 && m == 7) ? std::numeric_limits<float>::quiet_NaN()
                : e == 0             ? std::ldexp(static_cast<float>(m), -9)
                                     : std::ldexp(1.f + m / 8.f, e - 7);
      v[b] = s ? -x : x;
    }
  }
};
inline const E4m3Table& e4m3() {
  static const E4m3Table table;
  return table;
}

// |E2M1| of codes 0..7 (bits 2-1 exponent, bit 0 mantissa); bit 3 is the sign.
inline __m256 e2m1_magnitudes() { return _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f); }

// fp32 -> nearest bf16 (ties to even), kept as an fp32 (NaN stays NaN for quiet NaNs).
inline __m256 round_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The 8 decoded magnitudes |E2M1[c]| * t (bf16-rounded when x is bf16) of every block-scale
// byte, for one global scale: table[byte * 8 + c]. Built once per call (256 multiplies of 8
// lanes), it replaces the per-block multiply and rounding with one 32-byte load from L1.
template <bool kRoundBf16>
inline void magnitude_table(float global, float* table) {
  const __m256 mag_codes = e2m1_magnitudes();
  for (int b = 0; b < 256; ++b) {
    const float t = e4m3().v[b] * global;  // the reference's order: the two scales first
    __m256 mags = _mm256_mul_ps(mag_codes, _mm256_set1_ps(t));
    if (kRoundBf16) mags = round_bf16(mags);  // sign-symmetric: bf16(-v) == -bf16(v)
    _mm256_storeu_ps(table + b * 8, mags);
  }
}

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

// x rows [M, K] permuted to the decode order: per block, the 8 even elements then the 8
// odd ones; `pairs` (the AVX-512 order): per two blocks a, b: even a, even b, odd a, odd b
// (a final odd block as before).
inline std::vector<float> permute_x(const float* p, int64_t M, int64_t K, bool pairs) {
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m) {
    int64_t b = 0;
    if (pairs)
      for (; b + 2 * kBlock <= K; b += 2 * kBlock)
        for (int64_t h = 0; h < 2; ++h)      // block a, block b
          for (int64_t i = 0; i < 8; ++i) {  // elements 2i (even) and 2i+1 (odd) of the block
            out[m * K + b + h * 8 + i] = p[m * K + b + h * kBlock + 2 * i];
            out[m * K + b + 16 + h * 8 + i] = p[m * K + b + h * kBlock + 2 * i + 1];
          }
    for (; b < K; b += kBlock)
      for (int64_t i = 0; i < 8; ++i) {
        out[m * K + b + i] = p[m * K + b + 2 * i];
        out[m * K + b + 8 + i] = p[m * K + b + 2 * i + 1];
      }
  }
  return out;
}

// The decoded magnitudes of every scale byte for one global scale g (see magnitude_table):
// 8 per byte for the AVX2 rows, or 16 signed ones ([m, -m]) for the AVX-512 rows. A pure
// function of (g, rounding, path), so tables are built once per process and kept (a weight's
// global scale never changes; 8 or 16 KiB each, at most kMaxTables of them, after which
// new ones are built per call into `spill`).
constexpr size_t kMaxTables = 8192;

inline const float* table_for(float g, bool round_bf16, bool avx512, std::vector<float>& spill) {
  static std::mutex lock;
  static std::unordered_map<uint64_t, std::unique_ptr<std::vector<float>>> cache;
  uint32_t bits;
  std::memcpy(&bits, &g, sizeof bits);
  const uint64_t key = (static_cast<uint64_t>(bits) << 2) | (round_bf16 ? 2u : 0u) | (avx512 ? 1u : 0u);
  {
    std::lock_guard<std::mutex> hold(lock);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second->data();
  }
  std::vector<float> t8(256 * 8);
  if (round_bf16)
    magnitude_table<true>(g, t8.data());
  else
    magnitude_table<false>(g, t8.data());
  auto table = std::make_unique<std::vector<float>>();
  if (avx512) {
    table->resize(256 * 16);
    for (int64_t i = 0; i < 256; ++i)
      for (int64_t c = 0; c < 8; ++c) {
        (*table)[i * 16 + c] = t8[i * 8 + c];
        (*table)[i * 16 + 8 + c] = -t8[i * 8 + c];
      }
  } else {
    *table = std::move(t8);
  }
  std::lock_guard<std::mutex> hold(lock);
  if (cache.size() >= kMaxTables) {
    spill = std::move(*table);
    return spill.data();
  }
  auto& slot = cache[key];
  if (!slot) slot = std::move(table);  // (another thread may have built the same one)
  return slot->data();
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

// Rows [n0, n1) of y (fp32 [M, *], row stride ldy) from permuted x. One row of x: decode and multiply in
// registers. More rows: decode each weight row once into a scratch row (L1) and run the
// same accumulation for every x row from it, four x rows at a time.
inline void rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
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
