// `nvfp4_linear(x, codes, block_scales, global_scale)`: y[M, N] = x[M, K] @ W[N, K]^T with W
// an NVFP4 weight (/work/shared/NVFP4.md §2) decoded on the fly, weight-only: the activations
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
// AVX-512-BF16 CPUs (cpu_isa.h) run `musespark_avx512::nvfp4_rows`: two blocks per step,
// `vpermi2ps` over two 16-entry signed tables (|E2M1| * t and its negation, the same
// values), x in that path's order (per 32 elements: even of block a, even of block b, odd
// of a, odd of b; a final odd block: its 8 even then 8 odd). Same products, same weight
// values, a different fixed summation order (16 lanes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using musespark_simd::hsum;

constexpr int64_t kBlock = 16;

// The 256 e4m3fn bytes as fp32 (exact): bias 7, subnormals m * 2^-9, 0x7F / 0xFF NaN.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float x = (e == 15 && m == 7) ? std::numeric_limits<float>::quiet_NaN()
                : e == 0             ? std::ldexp(static_cast<float>(m), -9)
                                     : std::ldexp(1.f + m / 8.f, e - 7);
      v[b] = s ? -x : x;
    }
  }
};
const E4m3Table kE4m3;

// |E2M1| of codes 0..7 (bits 2-1 exponent, bit 0 mantissa); bit 3 is the sign.
inline __m256 e2m1_magnitudes() { return _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f); }

// fp32 -> nearest bf16 (ties to even), kept as an fp32 (NaN stays NaN for quiet NaNs).
inline __m256 round_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The 8 decoded magnitudes |E2M1[c]| * t (bf16-rounded when x is bf16) of every block-scale
// byte, for one global scale: table[byte * 8 + c]. Built once per call (256 multiplies of 8
// lanes), it replaces the per-block multiply and rounding with one 32-byte load from L1.
template <bool kRoundBf16>
void magnitude_table(float global, float* table) {
  const __m256 mag_codes = e2m1_magnitudes();
  for (int b = 0; b < 256; ++b) {
    const float t = kE4m3.v[b] * global;  // the reference's order: the two scales first
    __m256 mags = _mm256_mul_ps(mag_codes, _mm256_set1_ps(t));
    if (kRoundBf16) mags = round_bf16(mags);  // sign-symmetric: bf16(-v) == -bf16(v)
    _mm256_storeu_ps(table + b * 8, mags);
  }
}

// One block's 16 decoded weights: w0 = elements 0, 2, ..., 14 and w1 = 1, 3, ..., 15.
inline void decode_block(const uint8_t* codes, const float* mags_of_scale, __m256& w0, __m256& w1) {
  const __m256 mags = _mm256_loadu_ps(mags_of_scale);
  const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i even_sign = _mm256_and_si256(_mm256_slli_epi32(raw, 28), sign);  // bit 3 -> bit 31
  const __m256i odd_sign = _mm256_and_si256(_mm256_slli_epi32(raw, 24), sign);   // bit 7 -> bit 31
  // permutevar8x32 reads index bits 0-2 only: the low nibble's magnitude bits as they are.
  w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, raw), _mm256_castsi256_ps(even_sign));
  w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, _mm256_srli_epi32(raw, 4)), _mm256_castsi256_ps(odd_sign));
}

// x rows permuted to the decode order: per block, the 8 even elements then the 8 odd ones;
// `pairs` (the AVX-512 order): per two blocks a, b: even a, even b, odd a, odd b.
std::vector<float> permute_x(const at::Tensor& x, bool pairs) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> out(M * K);
  auto fill = [&](auto* p) {
    for (int64_t m = 0; m < M; ++m) {
      int64_t b = 0;
      if (pairs)
        for (; b + 2 * kBlock <= K; b += 2 * kBlock)
          for (int64_t h = 0; h < 2; ++h)      // block a, block b
            for (int64_t i = 0; i < 8; ++i) {  // element 2i (even) and 2i+1 (odd) of the block
              out[m * K + b + h * 8 + i] = static_cast<float>(p[m * K + b + h * kBlock + 2 * i]);
              out[m * K + b + 16 + h * 8 + i] = static_cast<float>(p[m * K + b + h * kBlock + 2 * i + 1]);
            }
      for (; b < K; b += kBlock)
        for (int64_t i = 0; i < 8; ++i) {
          out[m * K + b + i] = static_cast<float>(p[m * K + b + 2 * i]);
          out[m * K + b + 8 + i] = static_cast<float>(p[m * K + b + 2 * i + 1]);
        }
    }
  };
  if (x.scalar_type() == at::kFloat)
    fill(x.data_ptr<float>());
  else
    fill(x.data_ptr<at::BFloat16>());
  return out;
}

// Rows [n0, n1) of y (fp32 [M, N]) from permuted x. One row of x: decode and multiply in
// registers. More rows: decode each weight row once into a scratch row (L1) and run the
// same accumulation for every x row from it, four x rows at a time.
void rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales, const float* tables,
          int64_t rows_per_global, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  std::vector<float> scratch(M > 1 ? K : 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint8_t* s = scales + n * nb;
    const float* table = tables + (n / rows_per_global) * 256 * 8;
    if (M == 1) {
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        if ((b & 7) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(c + b * 8) + 1024, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(s + b) + 256, _MM_HINT_T0);
        }
        __m256 w0, w1;
        decode_block(c + b * 8, table + s[b] * 8, w0, w1);
        acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + b * kBlock), acc0);
        acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + b * kBlock + 8), acc1);
      }
      y[n] = hsum(_mm256_add_ps(acc0, acc1));
      continue;
    }
    float* w = scratch.data();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w0, w1;
      decode_block(c + b * 8, table + s[b] * 8, w0, w1);
      _mm256_storeu_ps(w + b * kBlock, w0);
      _mm256_storeu_ps(w + b * kBlock + 8, w1);
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      __m256 a0[4], a1[4];
      for (int r = 0; r < 4; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += kBlock) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int r = 0; r < 4; ++r) {
          a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + (m + r) * K + k), a0[r]);
          a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + (m + r) * K + k + 8), a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) y[(m + r) * N + n] = hsum(_mm256_add_ps(a0[r], a1[r]));
    }
    for (; m < M; ++m) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += kBlock) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xp + m * K + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xp + m * K + k + 8), a1);
      }
      y[m * N + n] = hsum(_mm256_add_ps(a0, a1));
    }
  }
}

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
  auto xc = x.contiguous();
  auto cc = codes.contiguous();
  auto sc = block_scales.contiguous();
  auto gc = global_scale.contiguous();
  auto y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const bool avx512 = musespark_isa::avx512_bf16();
  const std::vector<float> xp = permute_x(xc, avx512);
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  std::vector<float> yf(bf16 ? M * N : 0);
  float* out = bf16 ? yf.data() : y.data_ptr<float>();
  const auto* cp = cc.data_ptr<uint8_t>();
  const auto* sp = static_cast<const uint8_t*>(sc.data_ptr());
  const float* gp = gc.data_ptr<float>();
  const int64_t per_global = N / G;
  // ~64 KiB of codes per task: enough work to amortize a task, fine enough to balance.
  const int64_t grain = std::max<int64_t>(1, 65536 / (K / 2));
  std::vector<float> tables(G * 256 * 8);
  for (int64_t g = 0; g < G; ++g) {
    if (bf16)
      magnitude_table<true>(gp[g], tables.data() + g * 256 * 8);
    else
      magnitude_table<false>(gp[g], tables.data() + g * 256 * 8);
  }
  if (avx512) {  // signed 16-entry tables: [|E2M1| * t, -(|E2M1| * t)] per scale byte
    std::vector<float> signed_tables(G * 256 * 16);
    for (int64_t i = 0; i < G * 256; ++i)
      for (int64_t c = 0; c < 8; ++c) {
        signed_tables[i * 16 + c] = tables[i * 8 + c];
        signed_tables[i * 16 + 8 + c] = -tables[i * 8 + c];
      }
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      musespark_avx512::nvfp4_rows(xp.data(), M, K, cp, sp, signed_tables.data(), per_global, N, n0, n1, out);
    });
  } else {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      rows(xp.data(), M, K, cp, sp, tables.data(), per_global, N, n0, n1, out);
    });
  }
  if (bf16) {
    auto* yp = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) yp[i] = at::BFloat16(yf[i]);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("nvfp4_linear(Tensor x, Tensor codes, Tensor block_scales, Tensor global_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("nvfp4_linear", &nvfp4_linear);
}
