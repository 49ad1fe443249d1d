// `nvfp4_linear(x, codes, block_scales, global_scale)`: y[M, N] = x[M, K] @ W[N, K]^T with W
// an NVFP4 weight (docs/nvfp4.md §2) decoded on the fly, weight-only: the activations
// stay unquantized. AVX2 + FMA, for decode-sized M (any M works; the backend uses it for M <= 16).
//
// Inputs: x fp32 or bf16 [M, K] (K % 16 == 0); codes uint8 [N, K/2] (element 2j in the low
// nibble of byte j); block_scales e4m3 [N, K/16] (float8_e4m3fn or its uint8 view); global_scale
// fp32 with G elements, G dividing N: rows [g*N/G, (g+1)*N/G) use global_scale[g] (G = 1 for a
// linear, G = 2 for an expert's fused gate|up with its [2] weight_scale_2 row). Result [M, N]
// in x's dtype.
//
// Numerics = `Nvfp4Linear.apply` in weight-only mode (quant/nvfp4.py): per element
//   t = f32(e4m3(S[n, k/16])) * f32(global)      (fp32 multiply, RNE; scales first)
//   w = f32(E2M1[code]) * t                       (fp32 multiply, RNE)
//   w = bf16_rne(w) when x is bf16 (the reference rounds the decoded weight to x's dtype)
//   y[m, n] = sum_k x[m, k] * w[n, k] in fp32 (FMA), rounded once to x's dtype.
// Every product and every weight value is bit-identical to the reference; only the order of
// the fp32 summation differs (so results agree up to fp32 rounding of the sum, and a bf16
// output may differ by one bf16 ulp where the fp32 sum sits next to a rounding boundary).
//
// Batch invariance: y[m, n] is one dot product computed the same way (two 8-lane
// accumulators over the blocks of row n in order, then summed) whatever M is, so a row's
// result never depends on the other rows.
//
// Decoding: within a 16-element block the 8 code bytes are widened to 8 int32 lanes; the low
// nibble (bits 0-2 index, bit 3 sign) gives the even elements, the high nibble the odd ones.
// `_mm256_permutevar8x32_ps` looks up |E2M1| * t (the block's 8 magnitudes, from a per-call
// table indexed by the scale byte) and the sign bit is xored in. The activations are permuted once per call into the
// same even/odd order, so no shuffle of the weights is needed.
//
// Paths with AVX-512 (common/dispatch.h) run `musespark_avx512::nvfp4_rows`: two blocks per step,
// `vpermi2ps` over two 16-entry signed tables (|E2M1| * t and its negation, the same
// values), x in that path's order (per 32 elements: even of block a, even of block b, odd
// of a, odd of b; a final odd block: its 8 even then 8 odd). Same products, same weight
// values, a different fixed summation order (16 lanes). Paths with bf16 hardware run
// `musespark_avx512::nvfp4_rows_bf16` where x holds bf16 values: the same decoded weights and
// x in that order as bf16, one vdpbf16ps per 32 products (nvfp4/nvfp4_avx512_bf16.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../gemm/jobs.h"

#include <vector>

namespace {

constexpr int64_t kBlock = 16;

at::Tensor nvfp4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& block_scales,
                        const at::Tensor& global_scale) {
  TORCH_CHECK(x.dim() == 2, "nvfp4_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "nvfp4_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "nvfp4_linear: codes must be uint8 [N, K/2]");
  TORCH_CHECK(block_scales.dim() == 2 && block_scales.element_size() == 1 &&
                  (block_scales.scalar_type() == at::kByte || block_scales.scalar_type() == at::kFloat8_e4m3fn),
              "nvfp4_linear: block_scales must be float8_e4m3fn (or its uint8 view) [N, K/16]");
  TORCH_CHECK(global_scale.scalar_type() == at::kFloat && global_scale.numel() >= 1,
              "nvfp4_linear: global_scale must be a float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = global_scale.numel();
  TORCH_CHECK(K % kBlock == 0, "nvfp4_linear: K must be a multiple of 16, got ", K);
  TORCH_CHECK(codes.size(1) * 2 == K, "nvfp4_linear: codes are [", N, ", ", codes.size(1), "], x has K=", K);
  TORCH_CHECK(block_scales.size(0) == N && block_scales.size(1) * kBlock == K, "nvfp4_linear: block_scales are [",
              block_scales.size(0), ", ", block_scales.size(1), "], expected [", N, ", ", K / kBlock, "]");
  TORCH_CHECK(N % G == 0, "nvfp4_linear: ", G, " global scales do not divide N=", N);
  auto cc = codes.contiguous();
  auto sc = block_scales.contiguous();
  auto gc = global_scale.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto xf = x.to(at::kFloat).contiguous();
  auto yf = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return yf.to(x.scalar_type());
  musespark_gemv::Job job{xf.data_ptr<float>(), M, K, cc.data_ptr<uint8_t>(), false, N, yf.data_ptr<float>(), N, bf16,
                          static_cast<const uint8_t*>(sc.data_ptr()), gc.data_ptr<float>(), G};
  musespark_gemv::run_jobs({job});
  return bf16 ? yf.to(at::kBFloat16) : yf;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("nvfp4_linear(Tensor x, Tensor codes, Tensor block_scales, Tensor global_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("nvfp4_linear", &nvfp4_linear);
}
