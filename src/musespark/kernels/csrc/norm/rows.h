// Row-wise fp32 helpers shared by the CPU kernels. Each computes one row in a fixed order
// (sum_squares below), so a row's result never depends on the rows around it.
#pragma once
#include <c10/util/BFloat16.h>

#include <cmath>

#include "../common/simd.h"

namespace musespark_rows {

inline float round_bf16(float v) { return static_cast<float>(at::BFloat16(v)); }

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// sum(v[j]^2) over one row in a fixed order, whatever the row's neighbours: 16 lanes (two
// 8-wide FMA accumulators) over the leading multiple of 16, one more 8-wide block into the
// first accumulator, the lanes added in musespark_simd::hsum's fixed tree, then the last
// H % 8 values in turn. Why lanes: a sequential sum is one dependent add per value (about 4
// cycles each: 1.3 us per row of 1024), which made the norms of a 2048-token prompt ~20 % of
// its time (benchmarks/RESULTS.md, at 8f7bae9); the lanes' partial sums are also closer to
// the exact sum than a sequential one.
inline float sum_squares(const float* v, int64_t H) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= H; j += 16) {
    const __m256 x0 = _mm256_loadu_ps(v + j), x1 = _mm256_loadu_ps(v + j + 8);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
  }
  if (j + 8 <= H) {
    const __m256 x0 = _mm256_loadu_ps(v + j);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    j += 8;
  }
  float sum = musespark_simd::hsum(_mm256_add_ps(a0, a1));
  for (; j < H; ++j) sum += v[j] * v[j];
  return sum;
}

// The same in double (products and sums exact to ~1e-16 relative), 8 lanes in two 4-wide
// accumulators, the lanes added in a fixed order, then the last H % 8 values in turn.
inline double sum_squares_wide(const float* v, int64_t H) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 8 <= H; j += 8) {
    const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(v + j)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(v + j + 4));
    a0 = _mm256_fmadd_pd(x0, x0, a0);
    a1 = _mm256_fmadd_pd(x1, x1, a1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; j < H; ++j) sum += static_cast<double>(v[j]) * v[j];
  return sum;
}

// The RMSNorm family on one row of H values, fp32 with one rounding at the store:
//   plain:        y = x * rsqrt(mean(x^2) + eps) * gain * scale   (gain may be null)
//   input_scaled: v = x * gain; y = v * rsqrt(mean(v^2) + eps) * scale
// `tmp` holds H floats of scratch and aliases neither x nor y; y may be x (in place).
// `wide`: the sum of squares in double (fp32 models: their logits would show an fp32 sum's
// error); bf16 models keep the fp32 sum (the rounding to bf16 dominates).
template <typename In, typename Out>
inline void rms_row(const In* x, int64_t H, const float* gain, float eps, bool input_scaled, float scale,
                    float* tmp, Out* y, bool wide = false) {
  for (int64_t j = 0; j < H; ++j) {
    float v = static_cast<float>(x[j]);
    if (input_scaled) v *= gain[j];
    tmp[j] = v;
  }
  const float mean = wide ? static_cast<float>(sum_squares_wide(tmp, H) / static_cast<double>(H))
                          : sum_squares(tmp, H) / static_cast<float>(H);
  const float inv = 1.f / std::sqrt(mean + eps);
  for (int64_t j = 0; j < H; ++j) {
    float t = tmp[j] * inv;
    if (gain && !input_scaled) t *= gain[j];
    if (scale != 1.f) t *= scale;
    y[j] = static_cast<Out>(t);
  }
}

// The norm-preserving gated residual on one row: out = alpha * s + beta * n (out may be s).
inline void gated_residual_row(const float* s, const float* n, const float* alpha, const float* beta, int64_t H,
                               float* out) {
  for (int64_t j = 0; j < H; ++j) {
    const float a = alpha[j] * s[j], b = beta[j] * n[j];
    out[j] = a + b;
  }
}

// Rotary embedding, rotate-half form, in place on one head row of D values:
// r = r * cos + rotate_half(r) * sin, rotate_half(r) = (-r[D/2:], r[:D/2]).
inline void rope_row(float* r, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) tmp[i] = -r[half + i];
  for (int64_t i = half; i < D; ++i) tmp[i] = r[i - half];
  for (int64_t i = 0; i < D; ++i) r[i] = r[i] * cos[i] + tmp[i] * sin[i];
}

}  // namespace musespark_rows
