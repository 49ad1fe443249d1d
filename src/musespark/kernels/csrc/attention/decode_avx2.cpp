// Paged decode attention on AVX2 + FMA for one KV head (attention/decode_avx2.h;
// attention/decode_attention.cpp states the contract): fp32 scores and softmax, fp32, bf16 or
// fp8 e4m3 cache rows widened in registers.
#include "decode_avx2.h"

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/simd.h"

namespace musespark_attention {
namespace {

using musespark_simd::load8;

constexpr int64_t kAheadKeys = 8;

// The horizontal sums of 8 vectors, as one vector: lane j = sum of a[j]'s lanes.
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for x <= 0, 8 lanes (common/simd.h's exp8); x below -87 is clamped (exp ~ 1e-38,
// nothing next to the softmax's maximum term, which is 1).
inline __m256 exp_nonpositive(__m256 x) { return musespark_simd::exp8(x, -87.f); }

// s[0:L] <- softmax(s), fp32; the normalizer sums in key order.
inline void softmax(float* s, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < L; ++i) m = std::max(m, s[i]);
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= L; i += 8) _mm256_storeu_ps(s + i, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv)));
  if (i < L) {  // the tail through the same 8-lane code
    float tail[8];
    for (int64_t j = 0; j < 8; ++j) tail[j] = i + j < L ? s[i + j] - m : -87.f;
    _mm256_storeu_ps(tail, exp_nonpositive(_mm256_loadu_ps(tail)));
    for (int64_t j = 0; i + j < L; ++j) s[i + j] = tail[j];
  }
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += s[j];
  const float inv = 1.f / total;
  for (int64_t j = 0; j < L; ++j) s[j] *= inv;
}

}  // namespace

// One KV head, its G query heads, over the keys at `slots` (L of them). Each key row is
// widened once and dotted with every query head, 8 keys at a time; then each head's output
// accumulates the value rows in key order with its vectors in registers (value rows are in
// L1/L2 by then). scores: [G, L] scratch.
template <typename T>
void attend_head(const float* q, int64_t G, int64_t D, const T* k_cache, const T* v_cache, int64_t slot_stride,
                 const int64_t* slots, int64_t L, float scale, float* scores, float* out) {
  // Cache rows are scattered (one per slot, nKV * D apart): prefetch keys a few rows ahead,
  // and each value row while its key is used, for the second pass.
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  auto prefetch = [&](const T* p, int hint) {
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, static_cast<_mm_hint>(hint));
  };
  // Scores, 8 keys at a time: widen them into `rows` (zeros past the last key), then per
  // head one accumulator per key, reduced together (`hsum8`).
  std::vector<float> rows(static_cast<size_t>(8 * D));
  for (int64_t i0 = 0; i0 < L; i0 += 8) {
    const int64_t n = std::min<int64_t>(8, L - i0);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t i = i0 + j;
      if (i + kAheadKeys < L) prefetch(k_cache + slots[i + kAheadKeys] * slot_stride, _MM_HINT_T0);
      if (j < n) prefetch(v_cache + slots[i] * slot_stride, _MM_HINT_T1);
      const T* key = j < n ? k_cache + slots[i] * slot_stride : nullptr;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(rows.data() + j * D + d, key ? load8(key + d) : _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows.data() + j * D + d), acc[j]);
      }
      float got[8];
      _mm256_storeu_ps(got, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
      std::copy_n(got, n, scores + g * L + i0);
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax(scores + g * L, L);
  // out[g] = sum_i p[g, i] * v_i, keys in order, NV vectors of one head's output in registers.
  auto values = [&](auto nv, int64_t g, int64_t d0) {
    constexpr int NV = decltype(nv)::value;
    __m256 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
    const float* p = scores + g * L;
    for (int64_t i = 0; i < L; ++i) {
      const T* value = v_cache + slots[i] * slot_stride + d0;
      const __m256 w = _mm256_set1_ps(p[i]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(w, load8(value + 8 * j), acc[j]);
    }
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + g * D + d0 + 8 * j, acc[j]);
  };
  for (int64_t g = 0; g < G; ++g) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values(std::integral_constant<int, 8>{}, g, d0);
    for (; d0 < D; d0 += 8) values(std::integral_constant<int, 1>{}, g, d0);
  }
}

template void attend_head<float>(const float* q, int64_t G, int64_t D, const float* k_cache, const float* v_cache,
                                 int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                                 float* out);
template void attend_head<at::BFloat16>(const float* q, int64_t G, int64_t D, const at::BFloat16* k_cache,
                                        const at::BFloat16* v_cache, int64_t slot_stride, const int64_t* slots,
                                        int64_t L, float scale, float* scores, float* out);
template void attend_head<c10::Float8_e4m3fn>(const float* q, int64_t G, int64_t D,
                                              const c10::Float8_e4m3fn* k_cache, const c10::Float8_e4m3fn* v_cache,
                                              int64_t slot_stride, const int64_t* slots, int64_t L, float scale,
                                              float* scores, float* out);

}  // namespace musespark_attention
