// Small-M linear layers on x86 CPUs with AVX2+FMA: y[M, N] = x[M, K] @ w[N, K]^T.
//
// Why: decode multiplies a handful of rows by large weights, so it is bound by reading
// the weights. PyTorch's bf16 GEMM on CPUs without native bf16 (no avx512_bf16/AMX)
// converts at a few GB/s, far below memory bandwidth. Here each weight element is read
// once, widened to fp32 with a shift (bf16 is the top half of an fp32), and used for all
// M rows of x, which sit in L1.
//
// Invariants: x is fp32 or bf16 [M, K]; w is bf16 or fp32 contiguous [N, K];
// K % 8 == 0; the result is [M, N] in x's dtype. Accumulation is fp32, in 8 lanes summed at
// the end (a different order from MKL's, so fp32 results differ at rounding level).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <cmath>
#include <vector>

namespace {

using musespark_simd::hsum;
using musespark_simd::load8;

// Elements of W in one 64-byte cache line.
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);

// Rows this far ahead are prefetched: rows are short streams (K elements), too short for
// the hardware prefetcher to ramp up on its own.
constexpr int64_t kPrefetchRows = 4;

// NR weight rows times MR input rows: NR*MR independent accumulators.
template <typename W, int NR, int MR>
inline void tile(const float* x, int64_t K, const W* w, float* y, int64_t N) {
  __m256 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      __m256 wv = load8(w + n * K + k);
      for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  };
  constexpr int64_t L = kLine<W>;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int n = 0; n < NR; ++n)
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + n) * K + k), _MM_HINT_T0);
    for (int64_t j = 0; j < L; j += 8) step(k + j);
  }
  for (; k < K; k += 8) step(k);
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) y[m * N + n] = hsum(acc[n][m]);
}

template <typename W, int NR>
inline void rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<W, NR, 2>(x + m * K, K, w, y + m * N, N);
  if (m < M) tile<W, NR, 1>(x + m * K, K, w, y + m * N, N);
}

template <typename W>
void run(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  constexpr int NR = 4;
  // Chunks are whole 4-row tiles; each thread reads its own slice of the weight once.
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * NR;
      if (n + NR <= N) {
        rows<W, NR>(x, M, K, w + n * K, y + n, N);
      } else {
        for (int64_t r = n; r < N; ++r) rows<W, 1>(x, M, K, w + r * K, y + r, N);
      }
    }
  });
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_small_m: x [M, K] and w [N, K] must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "linear_small_m: x has K=", x.size(1), ", w has K=", w.size(1));
  TORCH_CHECK(x.size(1) % 8 == 0, "linear_small_m: K must be a multiple of 8, got ", x.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_small_m: x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "linear_small_m: w must be bfloat16 or float32");
  // The result has x's dtype, rounded once from the fp32 accumulators.
  auto xc = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = at::empty({M, N}, xc.options());
  if (M > 0 && N > 0) {
    if (wc.scalar_type() == at::kBFloat16)
      run(xc.data_ptr<float>(), M, K, wc.data_ptr<at::BFloat16>(), y.data_ptr<float>(), N);
    else
      run(xc.data_ptr<float>(), M, K, wc.data_ptr<float>(), y.data_ptr<float>(), N);
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

inline float round_bf16(float v) { return static_cast<float>(at::BFloat16(v)); }

// The routed experts of a MoE layer for a few tokens, bf16 weights: the rounding of
// every intermediate follows the bf16 model (each linear's output, silu, the product).
// x [T, Hm] bf16, ids [T, k] int64, gate_up [E, 2I, Hm] (gate
// rows first), down [E, Hm, I] -> y [T * k, Hm] bf16: row t*k + j is expert ids[t, j]
// applied to x[t], before its post-norm. Assignments are grouped by expert so that each
// expert's weights are read once.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "moe_experts: x must be bfloat16 [T, Hm]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "moe_experts: ids must be int64 [T, k]");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kBFloat16 &&
                  down.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() && down.is_contiguous(),
              "moe_experts: gate_up [E, 2I, Hm] and down [E, Hm, I] must be contiguous bfloat16");
  const int64_t T = x.size(0), k = ids.size(1), Hm = x.size(1);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == Hm && down.size(0) == E && down.size(1) == Hm && down.size(2) == I &&
                  Hm % 8 == 0 && I % 8 == 0,
              "moe_experts: shapes disagree (or Hm, I not multiples of 8)");
  auto xc = x.to(at::kFloat).contiguous();
  auto idc = ids.contiguous();
  const int64_t A = T * k;
  const int64_t* idp = idc.data_ptr<int64_t>();
  // Counting sort of the assignments by expert (stable).
  std::vector<int64_t> start(E + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(idp[a] >= 0 && idp[a] < E, "moe_experts: expert id ", idp[a], " out of range");
    ++start[idp[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[fill[idp[a]]++] = a;
  }
  std::vector<float> xs(A * Hm), h(A * 2 * I), act(A * I), ys(A * Hm);
  for (int64_t r = 0; r < A; ++r)
    std::copy_n(xc.data_ptr<float>() + (order[r] / k) * Hm, Hm, xs.data() + r * Hm);
  const auto* gu = gate_up.data_ptr<at::BFloat16>();
  const auto* dn = down.data_ptr<at::BFloat16>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = start[e], n = start[e + 1] - r0;
    if (n == 0) continue;
    run(xs.data() + r0 * Hm, n, Hm, gu + e * 2 * I * Hm, h.data() + r0 * 2 * I, 2 * I);
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* hr = h.data() + r * 2 * I;
      for (int64_t i = 0; i < I; ++i) {
        const float g = round_bf16(hr[i]), u = round_bf16(hr[I + i]);
        act[r * I + i] = round_bf16(round_bf16(g / (1.f + std::exp(-g))) * u);
      }
    }
    run(act.data() + r0 * I, n, I, dn + e * Hm * I, ys.data() + r0 * Hm, Hm);
  }
  auto y = at::empty({A, Hm}, xc.options().dtype(at::kBFloat16));
  auto* yp = y.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < A; ++r)
    for (int64_t j = 0; j < Hm; ++j) yp[order[r] * Hm + j] = at::BFloat16(ys[r * Hm + j]);
  return y;
}

}  // namespace

TORCH_LIBRARY(musespark_cpu, m) {
  m.def("linear_small_m(Tensor x, Tensor w) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor gate_up, Tensor down) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
  m.impl("moe_experts", &moe_experts);
}
