// `linear_small_m(x, w)`: y[M, N] = x[M, K] @ w[N, K]^T on x86 CPUs with AVX2+FMA, the
// products of gemm/jobs.h behind a torch op; `softcapped_logits` the same product with the
// head's soft cap applied on the way out.
//
// `panels` (optional): a bf16 w packed once (gemm/jobs.h panels_arg), multiplied by the
// AVX-512-BF16 panel kernel on that path and ignored on the others.
//
// Invariants: x is fp32 or bf16 [M, K]; w is bf16 or fp32 [N, K]; K % 8 == 0; the result
// is [M, N] in x's dtype, rounded once from fp32 accumulators (8 lanes summed at the end:
// a different order from MKL's, so fp32 results differ at rounding level).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tanh.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "../common/simd.h"
#include "jobs.h"

namespace {

// x @ w^T from fp32 accumulators: [M, N] fp32, whatever x's dtype (bf16 x is widened first).
at::Tensor products_fp32(const char* op, const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& prompt_rows = c10::nullopt,
                         const c10::optional<at::Tensor>& panels = c10::nullopt) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x [M, K] and w [N, K] must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x has K=", x.size(1), ", w has K=", w.size(1));
  TORCH_CHECK(x.size(1) % 8 == 0, op, ": K must be a multiple of 8, got ", x.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat, op,
              ": w must be bfloat16 or float32");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto xf = x.to(at::kFloat).contiguous();  // exact widening
  const auto wc = w.contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = wc.size(0);
  auto y = at::empty({M, N}, xf.options());
  const uint8_t* prompt = musespark_gemv::prompt_flags(prompt_rows, M, op);
  const uint32_t* packed = musespark_gemv::panels_arg(panels, wc, op);
  if (M > 0 && N > 0)
    musespark_gemv::run(xf.data_ptr<float>(), M, K, wc, y.data_ptr<float>(), /*x_bf16=*/bf16, prompt, packed);
  return y;
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& prompt_rows,
                          const c10::optional<at::Tensor>& panels) {
  const at::Tensor y = products_fp32("linear_small_m", x, w, prompt_rows, panels);
  return x.scalar_type() == at::kBFloat16 ? y.to(at::kBFloat16) : y;  // rounded once, to nearest even
}

// The soft-capped logits of a head: fp32 [M, N] = cap * tanh(y * multiplier / cap), y as
// linear_small_m(x, w) returns it (rounded to bf16 when x is bf16, as the head's output is)
// and widened. Every step is the fp32 operation torch's ops on y perform, tanh is torch's
// own (at::tanh_): the same bits as `cap * torch.tanh(y.float() * multiplier / cap)`, in
// place and on every thread instead of five passes with a new tensor each.
at::Tensor softcapped_logits(const at::Tensor& x, const at::Tensor& w, double multiplier, double cap,
                             const c10::optional<at::Tensor>& panels) {
  TORCH_CHECK(cap > 0, "softcapped_logits: cap must be positive, got ", cap);
  at::Tensor y = products_fp32("softcapped_logits", x, w, c10::nullopt, panels);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* p = y.data_ptr<float>();
  const int64_t n = y.numel();
  const float m = static_cast<float>(multiplier), c = static_cast<float>(cap);
  auto scaled = [&](int64_t i0, int64_t i1) {  // p = round(p) * m / c
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
      __m256 z = _mm256_loadu_ps(p + i);
      if (bf16) z = musespark_simd::round_bf16_8(z);
      _mm256_storeu_ps(p + i, _mm256_div_ps(_mm256_mul_ps(z, _mm256_set1_ps(m)), _mm256_set1_ps(c)));
    }
    for (; i < i1; ++i) p[i] = (bf16 ? static_cast<float>(at::BFloat16(p[i])) : p[i]) * m / c;
  };
  at::parallel_for(0, n, 8 * musespark_simd::kVectorGrain, scaled);
  return y.tanh_().mul_(cap);  // fp32 products with float(cap), as torch's `cap * t`
}

}  // namespace

TORCH_LIBRARY(musespark_cpu, m) {
  m.def("linear_small_m(Tensor x, Tensor w, Tensor? prompt_rows=None, Tensor? panels=None) -> Tensor");
  m.def("softcapped_logits(Tensor x, Tensor w, float multiplier, float cap, Tensor? panels=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
  m.impl("softcapped_logits", &softcapped_logits);
}
