// Shared AVX2 helpers of the CPU kernels.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

namespace musespark_simd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bf16 is the top half of an fp32: widen 8 values with a shift.
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace musespark_simd
