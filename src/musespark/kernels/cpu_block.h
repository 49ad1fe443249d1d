// Shared pieces of the fused decoder blocks (cpu_attn_block.cpp, cpu_ffn_block.cpp) for
// bf16 models on x86 CPUs (AVX2+FMA). One layer is four calls around the attention:
//   attn_in   input norm, Q/K/V/gate projections, QK-norm and rotary;
//   attn_out  O-norm and sigmoid gate, O projection, post-norm and gated residual;
//   ffn_dense pre-norm, SwiGLU MLP, post-norm and gated residual;
//   ffn_moe   pre-norm, router, pooler, pre-expert norm, the chosen experts, per-expert
//             post-norm, weighting and ordered sum, unpooler, post-norm, gated residual.
// The attention itself stays outside (layers/attention.py), so these serve every batch:
// prefill, decode and mixed.
//
// Why: a decode step multiplies one row per sequence by every weight, and in PyTorch each
// of a layer's ~70 small ops costs more in dispatch than in arithmetic. Here a layer is
// four calls, and the products of a step (q/k/v/gate; router and pooler; every chosen
// expert) share one parallel region.
//
// Numerics (SPEC §2-3), the same formulas as the PyTorch modules: the residual stream s is
// fp32 [T, H]; every norm computes in fp32; each value the bf16 model stores (a norm's
// output, each linear's output, silu, the SwiGLU product, the attention output) is rounded
// to bf16 where PyTorch would round it. Every row is computed by itself in a fixed order
// (cpu_gemv.h, cpu_rows.h), so a token's result never depends on its batch.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_gemv.h"
#include "cpu_rows.h"

#include <vector>

namespace musespark_block {

using at::Tensor;
using musespark_gemv::Job;
using musespark_gemv::job;
using musespark_gemv::run_jobs;
using musespark_rows::gated_residual_row;
using musespark_rows::rms_row;
using musespark_rows::rope_row;
using musespark_rows::round_bf16;
using musespark_rows::sigmoid;

constexpr int64_t kRowGrain = 16;  // rows per task in row loops (T = 1 runs inline)

inline void check_weight(const Tensor& w, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), name,
              " must be a contiguous bfloat16 matrix");
  TORCH_CHECK(w.size(0) == N && w.size(1) == K, name, " must be [", N, ", ", K, "], got ", w.sizes());
}

inline void check_vector(const Tensor& v, int64_t n, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.scalar_type() == at::kFloat && v.is_contiguous() && v.size(0) == n, name,
              " must be a contiguous float32 [", n, "]");
}

inline void check_stream(const Tensor& s, const char* op) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(1) % 8 == 0, op,
              ": s must be the contiguous float32 stream [T, H], H a multiple of 8");
}

inline void round_all(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = round_bf16(p[i]);
}

// Row-parallel loop: f(t, tmp) for every row t, tmp holding `scratch` floats per task.
template <typename F>
void for_rows(int64_t T, int64_t scratch, const F& f) {
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(scratch);
    for (int64_t t = t0; t < t1; ++t) f(t, tmp.data());
  });
}

// h[t] = bf16(rms(s[t]) * gain), kept as floats for the products.
inline std::vector<float> pre_norm(const float* s, int64_t T, int64_t H, const float* gain, float eps) {
  std::vector<float> h(T * H);
  for_rows(T, H, [&](int64_t t, float* tmp) {
    rms_row(s + t * H, H, gain, eps, false, 1.f, tmp, h.data() + t * H);
    round_all(h.data() + t * H, H);
  });
  return h;
}

// The stream update shared by both halves of a layer: s' = alpha * s + beta * norm(b),
// norm weightless (gain null) or input-scaled by gain. b [T, H] holds bf16 values.
inline Tensor residual(const Tensor& s, const float* b, const float* gain, float eps, const Tensor& alpha,
                       const Tensor& beta) {
  const int64_t T = s.size(0), H = s.size(1);
  Tensor out = s.clone();
  float* op = out.data_ptr<float>();
  const float *ap = alpha.data_ptr<float>(), *bp = beta.data_ptr<float>();
  for_rows(T, 2 * H, [&](int64_t t, float* tmp) {
    rms_row(b + t * H, H, gain, eps, gain != nullptr, 1.f, tmp, tmp + H);
    gated_residual_row(op + t * H, tmp + H, ap, bp, H);
  });
  return out;
}

inline void check_residual(const Tensor& s, const Tensor& alpha, const Tensor& beta) {
  check_vector(alpha, s.size(1), "alpha");
  check_vector(beta, s.size(1), "beta");
}

}  // namespace musespark_block
