// AVX-512 helpers shared by the files compiled for AVX-512 (the *_avx512.cpp and *_amx.cpp
// files): included after their `#pragma GCC target`, never by the AVX2 world (common/isa.h);
// internal linkage, so every file inlines its own copy.
#pragma once
// Needs, included before the pragma: <cstdint> <immintrin.h>.

namespace musespark_simd512 {
namespace {

// 32 bf16 values (bits) as one vdpbf16ps operand; the masked form zeroes the lanes past `m`.
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// The fixed lane sum of every accumulator (the same code for every tile shape).
inline float sum16(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// exp(x) for x <= 0, 16 lanes (the Cephes polynomial of common/simd.h's exp8; x < -87 gives ~1e-38).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Which of the 16 keys at positions first .. first + 15 a query at position pos reaches in
// prompt attention: (pos - window, pos] (window 0: every key up to pos), below `end` (one
// past the last key's position).
inline __mmask16 reachable16(int64_t first, int64_t pos, int64_t end, int64_t window) {
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __mmask16 ok = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos))) &
                 _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(end)));
  if (window > 0) ok &= _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos - window)));
  return ok;
}

}  // namespace
}  // namespace musespark_simd512
