// Shared pieces of the fused decoder blocks (blocks/attn_block.cpp, blocks/ffn_block.cpp) for
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
// Numerics (docs/spec.md §2-3), the same formulas as the PyTorch modules: the residual stream s is
// fp32 [T, H]; every norm computes in fp32; each value the bf16 model stores (a norm's
// output, each linear's output, silu, the SwiGLU product, the attention output) is rounded
// to bf16 where PyTorch would round it. Every row is computed by itself in a fixed order
// (gemm/jobs.h, norm/rows.h), so a token's result never depends on its batch.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "../common/simd.h"
#include "../gemm/jobs.h"
#include "../norm/rows.h"

#include <vector>

namespace musespark_block {

using at::Tensor;
using musespark_gemv::Job;
using musespark_gemv::run_jobs;
using musespark_rows::gated_residual_row;
using musespark_rows::rms_row;
using musespark_rows::rope_row;
using musespark_rows::round_bf16;
using musespark_rows::sigmoid;

constexpr int64_t kRowGrain = 16;  // rows per task in row loops (T = 1 runs inline)

// A weight argument of the fused blocks (schema `Tensor[]`): [w], a contiguous bf16 or fp32
// matrix [N, K] (experts: [E, N, K]); [w, panels], a bf16 weight with its panels packed once
// (gemm/jobs.h panels_arg; experts: each expert's panels in turn); or an NVFP4 weight
// (weight-only; nvfp4/nvfp4_linear.cpp): [codes uint8 [(E,) N, K/2], block scales float8_e4m3fn or
// uint8 [(E,) N, K/16], global scales fp32 with (E x) G elements, G dividing N]. Views into
// the tensors: they must outlive the call.
struct Weight {
  const uint8_t* w = nullptr;  // bf16 or fp32 elements, or NVFP4 codes
  const uint32_t* packed = nullptr;  // the panels of [w, panels]
  int64_t packed_stride = 0;  // words per expert's panels
  const uint8_t* scales = nullptr;
  const float* globals = nullptr;
  int64_t E = 0, N = 0, K = 0, G = 1;
  int64_t w_stride = 0, s_stride = 0;  // bytes per expert
  bool fp32 = false;

  bool nvfp4() const { return scales != nullptr; }
  // y[M, N] (row stride ldy) = x[M, K] @ W[e]^T; bf16: x holds bf16 values (a bf16 model).
  // `prompt`: per row of x, nonzero for a prompt row (gemm/jobs.h split_prompt_runs), or null.
  Job job(const float* x, int64_t M, float* y, int64_t ldy, bool bf16, int64_t e = 0,
          const uint8_t* prompt = nullptr) const {
    Job j{x, M, K, w + e * w_stride, !nvfp4() && !fp32, N, y, ldy, bf16};
    j.prompt = prompt;
    j.packed = packed ? packed + e * packed_stride : nullptr;
    if (nvfp4()) {
      j.scales = scales + e * s_stride;
      j.globals = globals + e * G;
      j.G = G;
    }
    return j;
  }
};

// Reads and checks a weight argument; `experts`: a leading expert dimension. The caller
// checks N and K against the model (check_shape).
Weight weight_arg(at::TensorList parts, bool experts, const char* name);

inline void check_shape(const Weight& w, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(w.N == N && w.K == K, name, " must be [", N, ", ", K, "] (as bf16 elements), got [", w.N, ", ", w.K,
              "]");
}

inline void check_vector(const Tensor& v, int64_t n, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.scalar_type() == at::kFloat && v.is_contiguous() && v.size(0) == n, name,
              " must be a contiguous float32 [", n, "]");
}

inline void check_stream(const Tensor& s, const char* op) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(1) % 8 == 0, op,
              ": s must be the contiguous float32 stream [T, H], H a multiple of 8");
}

// Rounds a row to bf16 where a bf16 model stores it; an fp32 model stores fp32 (nothing to
// do). On the calling thread: row loops call it (each output is rounded by the row loop that
// reads it, while the row is in cache; a parallel_for per row would cost more than the row).
inline void round_row(float* p, int64_t n, bool bf16) {
  if (!bf16) return;
  for (int64_t i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, musespark_simd::round_bf16_8(_mm256_loadu_ps(p + i)));
  for (int64_t i = n / 8 * 8; i < n; ++i) p[i] = round_bf16(p[i]);
}

// Row-parallel loop: f(t, tmp) for every row t, tmp holding `scratch` floats per task.
template <typename F>
void for_rows(int64_t T, int64_t scratch, const F& f) {
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(scratch);
    for (int64_t t = t0; t < t1; ++t) f(t, tmp.data());
  });
}

// The fused blocks' intermediate arrays, one slot each, reused across calls by the calling
// thread (an op never calls another): a prefill's arrays are tens of MiB, and fresh ones
// would be faulted in and zeroed on every call. Contents are whatever the last call left:
// every user writes what it reads. The buffers keep their largest size.
enum Slot { kNormed, kProj, kGateUp, kAct, kOut, kPooled, kExpertIn, kExpertOut, kLogits, kMixed, kSlots };

float* scratch(Slot slot, int64_t n);

// h[t] = bf16(rms(s[t]) * gain) (fp32 models: unrounded), kept as floats for the products:
// [T, H] in scratch slot kNormed.
float* pre_norm(const float* s, int64_t T, int64_t H, const float* gain, float eps, bool bf16);

// The stream update shared by both halves of a layer, into a new stream:
// s' = alpha * s + beta * norm(b), norm weightless (gain null) or input-scaled by gain.
// b [T, H] is the block's fp32 output, rounded here (in place, row by row while it is in
// cache) to the model's values.
Tensor residual(const Tensor& s, float* b, const float* gain, float eps, const Tensor& alpha, const Tensor& beta,
                bool bf16);

inline void check_residual(const Tensor& s, const Tensor& alpha, const Tensor& beta) {
  check_vector(alpha, s.size(1), "alpha");
  check_vector(beta, s.size(1), "beta");
}

}  // namespace musespark_block
