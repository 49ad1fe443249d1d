// `linear_small_m(x, w)`: y[M, N] = x[M, K] @ w[N, K]^T on x86 CPUs with AVX2+FMA, the
// kernel of cpu_gemv.h behind a torch op.
//
// Invariants: x is fp32 or bf16 [M, K]; w is bf16 or fp32 [N, K]; K % 8 == 0; the result
// is [M, N] in x's dtype, rounded once from fp32 accumulators (8 lanes summed at the end:
// a different order from MKL's, so fp32 results differ at rounding level).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_gemv.h"
#include "cpu_isa.h"

#include <atomic>
#include <string>

#include <vector>

namespace musespark_isa {

namespace {
std::atomic<int> current{kAvx2};
std::atomic<bool> invariant{true};
}  // namespace

int level() { return current.load(std::memory_order_relaxed); }
bool batch_invariant() { return invariant.load(std::memory_order_relaxed); }
void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }

bool set_level(int want) {
  if (want >= kAvx512Bf16) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512bf16")))
      return false;
  }
  current.store(want >= kAvx512Bf16 ? kAvx512Bf16 : kAvx2, std::memory_order_relaxed);
  return true;
}

}  // namespace musespark_isa

namespace {

// The kernels' code path: "avx2" or "avx512_bf16" (cpu_isa.h). Returns the path now in use.
std::string set_isa(const std::string& path) {
  TORCH_CHECK(path == "avx2" || path == "avx512_bf16", "set_isa: expected 'avx2' or 'avx512_bf16', got '", path, "'");
  TORCH_CHECK(musespark_isa::set_level(path == "avx2" ? musespark_isa::kAvx2 : musespark_isa::kAvx512Bf16),
              "set_isa: this CPU cannot run the ", path, " kernels");
  return path;
}

std::string isa_path() { return musespark_isa::avx512_bf16() ? "avx512_bf16" : "avx2"; }

// Batch invariance on or off (cpu_isa.h); returns the previous setting.
bool set_batch_invariant(bool on) {
  const bool before = musespark_isa::batch_invariant();
  musespark_isa::set_batch_invariant(on);
  return before;
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_small_m: x [M, K] and w [N, K] must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "linear_small_m: x has K=", x.size(1), ", w has K=", w.size(1));
  TORCH_CHECK(x.size(1) % 8 == 0, "linear_small_m: K must be a multiple of 8, got ", x.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_small_m: x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "linear_small_m: w must be bfloat16 or float32");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (xc.scalar_type() == at::kFloat) {
    musespark_gemv::run(xc.data_ptr<float>(), M, K, wc, y.data_ptr<float>(), /*x_bf16=*/false);
    return y;
  }
  // bf16 x: widen into scratch, accumulate in fp32, round once into y.
  std::vector<float> xf(M * K), yf(M * N);
  const auto* xp = xc.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  musespark_gemv::run(xf.data(), M, K, wc, yf.data(), /*x_bf16=*/true);
  auto* yp = y.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) yp[i] = at::BFloat16(yf[i]);
  return y;
}

}  // namespace

TORCH_LIBRARY(musespark_cpu, m) {
  m.def("linear_small_m(Tensor x, Tensor w) -> Tensor");
  m.def("set_isa(str path) -> str", &set_isa);  // no tensor arguments: catch-all kernels
  m.def("isa_path() -> str", &isa_path);
  m.def("set_batch_invariant(bool on) -> bool", &set_batch_invariant);
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
}
