// Shared AVX2 helpers of the CPU kernels.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace musespark_simd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bf16 is the top half of an fp32: widen 8 values with a shift.
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// float8 e4m3 (the fp8 KV cache, layers/kv_quant.py; scale 1.0: the values as stored), 8 values:
// a normal value's 4 exponent and 3 mantissa bits placed under an fp32 exponent rebiased by
// 127 - 7; a subnormal one (exponent bits 0) is m * 2^-9, exact in fp32; then the sign. Every
// finite e4m3 value converts exactly (the NaN pattern, never stored, reads as 480).
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), _mm256_castsi256_ps(sign));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x), 8 lanes, for any x: clamped to [lo, 88.3] (lo = -87.3 by default: exp is then
// ~1e-38 or ~2e38, where every caller's result is already settled), Cody-Waite reduction x = n ln2 + r and
// the Cephes expf polynomial: relative error about 1e-7 (1-2 ulp from the correctly
// rounded value). Used where the fused blocks need exp element-wise (silu, sigmoid), so
// each element's value never depends on how many rows share the loop.
inline __m256 exp8(__m256 x, float lo = -87.3f) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// 1 / (1 + exp(-x)) and x / (1 + exp(-x)), 8 lanes (IEEE division, as the scalar formulas).
inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
inline __m256 silu8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// fp32 -> nearest bf16 (ties to even), kept as fp32; 8 lanes (finite inputs; NaN stays NaN
// when quiet). The same bits as at::BFloat16(v) for every finite v.
inline __m256 round_bf16_8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline float bf16_to_float(uint16_t bits) {  // exact: bf16 is the top half of an fp32
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Vectors of 8 per task when an elementwise pass over a prompt's array is split between
// threads; a decode step's arrays (up to 256K values) stay on the calling thread, where the
// pass costs less than waking and joining the others.
constexpr int64_t kVectorGrain = 1 << 15;

// dst[0:n] = bf16 bits of src[0:n], rounded to nearest even as at::BFloat16(v) (finite v;
// exact for values that are bf16 already), 8 at a time, on the calling thread.
inline void bf16_bits_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(_mm256_loadu_ps(src + i))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
  for (int64_t i = n / 8 * 8; i < n; ++i) dst[i] = at::BFloat16(src[i]).x;
}
// The same over a whole array, a prompt's split between the threads.
inline void to_bf16_bits(const float* src, uint16_t* dst, int64_t n) {
  at::parallel_for(0, n / 8, kVectorGrain, [&](int64_t v0, int64_t v1) {
    bf16_bits_row(src + 8 * v0, dst + 8 * v0, 8 * (v1 - v0));
  });
  bf16_bits_row(src + n / 8 * 8, dst + n / 8 * 8, n % 8);
}
// dst[0:n] = src[0:n] in the model's dtype: bf16 (bf16_bits_row) or fp32 (a copy); one row,
// on the calling thread (row loops call it per head: a parallel_for per call cost more than
// the row, inside a region too).
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  bf16_bits_row(src, reinterpret_cast<uint16_t*>(dst), n);
}
inline void store_row(const float* src, float* dst, int64_t n) { std::copy_n(src, n, dst); }

}  // namespace musespark_simd
