// Row-wise fp32 helpers shared by the CPU kernels. Each computes one row in a fixed order
// (sequential sums), so a row's result never depends on the rows around it.
#pragma once
#include <ATen/ATen.h>

#include <cmath>

namespace musespark_rows {

inline float round_bf16(float v) { return static_cast<float>(at::BFloat16(v)); }

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// The RMSNorm family on one row of H values, fp32 with one rounding at the store:
//   plain:        y = x * rsqrt(mean(x^2) + eps) * gain * scale   (gain may be null)
//   input_scaled: v = x * gain; y = v * rsqrt(mean(v^2) + eps) * scale
// `tmp` holds H floats of scratch and aliases neither x nor y; y may be x (in place).
// `wide`: the sum of squares in double (fp32 models: a sequential fp32 sum grows an error of
// ~H ulps, which their logits would show); bf16 models keep the fp32 sum (the rounding to
// bf16 dominates).
template <typename In, typename Out>
inline void rms_row(const In* x, int64_t H, const float* gain, float eps, bool input_scaled, float scale,
                    float* tmp, Out* y, bool wide = false) {
  float sq = 0.f;
  double wsq = 0.0;
  for (int64_t j = 0; j < H; ++j) {
    float v = static_cast<float>(x[j]);
    if (input_scaled) v *= gain[j];
    tmp[j] = v;
    if (wide)
      wsq += static_cast<double>(v) * v;
    else
      sq += v * v;
  }
  const float mean = wide ? static_cast<float>(wsq / static_cast<double>(H)) : sq / static_cast<float>(H);
  const float inv = 1.f / std::sqrt(mean + eps);
  for (int64_t j = 0; j < H; ++j) {
    float t = tmp[j] * inv;
    if (gain && !input_scaled) t *= gain[j];
    if (scale != 1.f) t *= scale;
    y[j] = static_cast<Out>(t);
  }
}

// The norm-preserving gated residual on one row: s = alpha * s + beta * n.
inline void gated_residual_row(float* s, const float* n, const float* alpha, const float* beta, int64_t H) {
  for (int64_t j = 0; j < H; ++j) {
    const float a = alpha[j] * s[j], b = beta[j] * n[j];
    s[j] = a + b;
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
