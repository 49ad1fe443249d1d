// bf16 weights widened to fp32 on AVX-512F: musespark_avx512::widened_rows (gemm/gemm_kernels.h),
// the avx512 path's kernel for bf16 products on CPUs without bf16 hardware (common/dispatch.h).
//
// The AVX2 tiles (gemm/avx2_tiles.h) with 16 lanes: each weight element is read once, widened
// to fp32 in a register and multiplied into every row of x by fp32 FMAs. On a two-core Xeon
// without bf16 hardware, the 8-row products of batched decode and the prompts' products are
// bound by the FMAs, not by memory (benchmarks/RESULTS.md), so the widening is kept to one
// instruction per 16 weights: 32 bf16 weights are 16 words of (w[2j], w[2j + 1]) pairs, the
// even weights the words shifted left by 16 and the odd ones the words with the low half
// cleared. x comes permuted to match (nvfp4/nvfp4_tables.h permute_x, the pairs order: per 32
// elements the 16 even then the 16 odd; a last 16: its 8 even then 8 odd).
//
// Invariant (batch invariance): every y[m, n] is one dot product computed the same way, one
// 16-lane FMA chain over K in order (per 32 elements: the even products, then the odd ones; a
// last 16 as one vector), then the fixed lane sum `sum16`, whatever M, the tile it falls in or
// how the rows are split.
//
// Compiled for AVX-512F/BW/VL/DQ (no BF16) by the pragma below and reached only through the
// dispatch table on CPUs that run it. No ATen or standard-library header after the pragma
// (common/isa.h).
#include <cstdint>
#include <immintrin.h>

#include "gemm_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

#include "../common/simd512.h"

namespace musespark_avx512 {

using musespark_simd512::sum16;

namespace {

// The even and odd weights of 32 bf16 weights (bits) as fp32.
inline void widen32(const uint16_t* w, __m512& even, __m512& odd) {
  const __m512i words = _mm512_loadu_si512(w);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// A last 16 bf16 weights as fp32 in x's tail order: [8 even | 8 odd].
inline __m512 widen_tail(const uint16_t* w) {
  const __m512i words = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(
      0xff00, _mm512_slli_epi32(words, 16), _mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
}

// NR weight rows (row r at w + r * ldw) times MR rows of permuted x (row stride K): NR * MR
// accumulators; y[m * ldy + r * ldn]. `ahead`: bytes past the current line of each weight row
// to prefetch (0: none; far-apart rows are long streams the hardware prefetchers follow).
template <int NR, int MR>
inline void tile(const float* x, int64_t K, const uint16_t* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                 int64_t ahead) {
  __m512 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // one 64-byte line of each weight row
    if (ahead != 0)
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + ahead, _MM_HINT_T0);
    __m512 xe[MR], xo[MR];
    for (int m = 0; m < MR; ++m) {
      xe[m] = _mm512_loadu_ps(x + m * K + k);
      xo[m] = _mm512_loadu_ps(x + m * K + k + 16);
    }
    for (int n = 0; n < NR; ++n) {
      __m512 we, wo;
      widen32(w + n * ldw + k, we, wo);
      for (int m = 0; m < MR; ++m) acc[n][m] = _mm512_fmadd_ps(wo, xo[m], _mm512_fmadd_ps(we, xe[m], acc[n][m]));
    }
  }
  if (k < K)  // K % 32 == 16
    for (int n = 0; n < NR; ++n) {
      const __m512 wt = widen_tail(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[n][m] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(x + m * K + k), acc[n][m]);
    }
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) y[m * ldy + n * ldn] = sum16(acc[n][m]);
}

// NR weight rows against all M rows of x, MR = 4 rows at a time (4 x 4 tiles: 16
// accumulators, 8 x registers (even and odd), 2 weight registers of the 32), the last rows in a
// shorter tile.
template <int NR>
inline void tile_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, float* y, int64_t ldy,
                      int64_t ldn, int64_t ahead) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<NR, 4>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead);
  switch (M - m) {
    case 3: tile<NR, 3>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead); break;
    case 2: tile<NR, 2>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead); break;
    case 1: tile<NR, 1>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead); break;
    default: break;
  }
}

constexpr int kNR = 4;            // weight rows per tile (gemm/jobs.h kNR: run_jobs splits tiles of this many)
constexpr int64_t kStreamMax = 3;  // rows of x up to which the weight is read as far-apart streams
constexpr int64_t kXBlockBytes = 256 * 1024;  // x taken in blocks of about this much (L2), as the AVX2 tiles

}  // namespace

void widened_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                  int64_t ldy) {
  if (M <= kStreamMax) {
    // kNR streams in lockstep: step i multiplies rows n0 + i, n0 + q + i, ... (gemm/avx2_tiles.h
    // stream_rows says why), the rows past kNR * q one at a time.
    const int64_t q = (n1 - n0) / kNR;
    for (int64_t i = 0; i < q; ++i) tile_rows<kNR>(x, M, K, w + (n0 + i) * K, q * K, y + n0 + i, ldy, q, 0);
    for (int64_t n = n0 + kNR * q; n < n1; ++n) tile_rows<1>(x, M, K, w + n * K, K, y + n, ldy, 1, 0);
    return;
  }
  // Adjacent tiles, each prefetching the next; x in blocks that stay in L2 over the range.
  const int64_t ahead = kNR * K * 2;
  const int64_t block = M * K * 4 <= kXBlockBytes ? M : (kXBlockBytes / (4 * K) / 4 + 1) * 4;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t mb = M - m0 < block ? M - m0 : block;
    int64_t n = n0;
    for (; n + kNR <= n1; n += kNR) tile_rows<kNR>(x + m0 * K, mb, K, w + n * K, K, y + m0 * ldy + n, ldy, 1, ahead);
    for (; n < n1; ++n) tile_rows<1>(x + m0 * K, mb, K, w + n * K, K, y + m0 * ldy + n, ldy, 1, ahead);
  }
}

}  // namespace musespark_avx512
