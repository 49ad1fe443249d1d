// The bf16 dot-product kernel on AVX-512-BF16 (vdpbf16ps): musespark_avx512::bf16_dots,
// gemm/gemm_kernels.h states the contract.
// Compiled for AVX-512F/BW/VL/DQ + BF16 by the pragma below and reached only through the
// dispatch table (common/dispatch.h) on paths whose CPU runs it. No ATen or standard-library
// header after the pragma (common/isa.h: no inline function compiled for AVX-512 may leak into
// the AVX2 world).
#include <cstdint>
#include <immintrin.h>

#include "../common/thresholds.h"
#include "gemm_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

#include "../common/simd512.h"

namespace musespark_avx512 {
namespace {

using musespark_simd512::load_bh;
using musespark_simd512::sum16;

// Weight rows per tile, x rows per tile: 4 x 6 = 24 zmm accumulators + 4 weights + 1 x.
constexpr int kNR = 4;
constexpr int kMR = 6;
// x rows per chunk: the chunk's bf16 rows stay in L2 (~256 KiB) while every weight tile
// of the thread's slice passes over them; the weights are re-read once per chunk.
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int64_t kRowAhead = 4096;  // bytes prefetched ahead in a one-row-of-x product
using musespark_rows::kPrefetchMaxRows;  // common/thresholds.h

// Prefetches the weight line at p (the dot-product kernel's; the panel kernel below leaves
// its sequential stream to the hardware). `once`: no later tile of this call reads it again,
// so it is fetched non-temporally, without pushing the caller's working set (the stream, the
// interpreter's objects between calls) out of L2 and L3: a decode step reads hundreds of MiB
// of weights once each (benchmarks/RESULTS.md, at cbaa67f). Where a line lands never changes
// the values read. (The AVX2 kernels keep T0: no gain measured there.)
inline void prefetch_weight(const void* p, bool once) {
  if (once)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

// NR weight rows x MR x rows; acc[n][m] += w[n, k:k+32] . x[m, k:k+32] over K in order,
// the last partial step zero-masked (adding +0 products changes no sum).
template <int NR, int MR>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t ldy, int64_t ahead,
                 bool once) {
  __m512 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NR];
    for (int n = 0; n < NR; ++n) {
      if (ahead) prefetch_weight(reinterpret_cast<const char*>(w + n * K + k) + ahead, once);
      wv[n] = load_bh(w + n * K + k);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = load_bh(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], wv[n], xv);
    }
  }
  if (k < K) {
    const __mmask32 mask = (1u << (K - k)) - 1u;
    __m512bh wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load_bh(w + n * K + k, mask);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = load_bh(x + m * K + k, mask);
      for (int n = 0; n < NR; ++n) acc[n][m] = _mm512_dpbf16_ps(acc[n][m], wv[n], xv);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = sum16(acc[n][m]);
}

// NR weight rows against x rows [0, M) (M <= chunk): ceil(M / kMR) tiles of near-equal
// height (32 rows: 6 6 5 5 5 5, not 6 x 5 + 2, whose 2-row tile reloads the weights for few
// products). Each element's sum is the same in a tile of any height.
template <int NR>
inline void rows_of_tile(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t ldy,
                         int64_t prefetch) {
  const int64_t tiles = (M + kMR - 1) / kMR;
  const int64_t base = tiles ? M / tiles : 0, taller = tiles ? M % tiles : 0;
  const bool once = tiles == 1;  // no other tile of x reads these weight rows
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t h = base + (t < taller ? 1 : 0);
    const uint16_t* xt = x + m * K;
    float* yt = y + m * ldy;
    switch (h) {
      case 6: tile<NR, 6>(xt, K, w, yt, ldy, prefetch, once); break;
      case 5: tile<NR, 5>(xt, K, w, yt, ldy, prefetch, once); break;
      case 4: tile<NR, 4>(xt, K, w, yt, ldy, prefetch, once); break;
      case 3: tile<NR, 3>(xt, K, w, yt, ldy, prefetch, once); break;
      case 2: tile<NR, 2>(xt, K, w, yt, ldy, prefetch, once); break;
      default: tile<NR, 1>(xt, K, w, yt, ldy, prefetch, once); break;
    }
    m += h;
  }
}

}  // namespace

void bf16_dots(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
               int64_t ldy) {
  int64_t chunk = kChunkBytes / (2 * K);
  chunk = chunk < kMR ? kMR : chunk - chunk % kMR;
  // Decode-sized M streams the weights and prefetches ahead of each row's reads: up to kMR
  // rows of x go weight row by weight row, one sequential stream 4 KiB ahead (measured best
  // here: 44-50 GB/s from DRAM on 2 threads against 37-47 for 4-row tiles at one row of x;
  // 1.1-1.3x at 2-6 rows); more rows use 4-row tiles, reusing each x load four times, and
  // fetch the next tile. (Each element's sum is the same whichever: batch invariant.)
  if (M <= kMR) {
    for (int64_t n = n0; n < n1; ++n) rows_of_tile<1>(x, M, K, w + n * K, y + n, ldy, kRowAhead);
    return;
  }
  const int64_t ahead = M <= kPrefetchMaxRows ? kNR * K * 2 : 0;
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t mc = M - c0 < chunk ? M - c0 : chunk;
    const uint16_t* xc = x + c0 * K;
    float* yc = y + c0 * ldy;
    int64_t n = n0;
    for (; n + kNR <= n1; n += kNR) rows_of_tile<kNR>(xc, mc, K, w + n * K, yc + n, ldy, ahead);
    for (; n < n1; ++n) rows_of_tile<1>(xc, mc, K, w + n * K, yc + n, ldy, 0);
  }
}

}  // namespace musespark_avx512
