// The AVX2 + FMA products: y[M, N] = x[M, K] @ w[N, K]^T with bf16 or fp32 weights widened to
// fp32 in registers (bf16 is the top half of an fp32), fp32 accumulation (double for fp32
// weights in fp32 models). The kernel every path runs for the products the dispatch table
// (common/dispatch.h) gives no other kernel: all of them on avx2, fp32 weights on every path.
//
// Why: decode multiplies a handful of rows by large weights, so it is bound by reading
// the weights. Each weight element is read once, widened to fp32 in registers and used for
// all M rows of x, which sit in L1.
//
// Invariant (batch invariance): every output element is one dot product computed the
// same way (8 fp32 lanes over K in order, then `hsum`) whatever M, the tile it falls in or
// the job list it is part of, so a row's result never depends on the other rows.
//
// Hot inner loops: inline templates, instantiated where run_jobs runs them (gemm/jobs.cpp).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/simd.h"
#include "jobs.h"

namespace musespark_gemv {

using musespark_simd::hsum;
using musespark_simd::load8;

// Elements of W in one 64-byte cache line.
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);

// Software prefetch in weight_tile: rows are short streams (K elements), too short for the
// hardware prefetcher to ramp up on its own, so a 4-row tile prefetches the tile after it.
constexpr int64_t kPrefetchRows = 4;

// NR weight rows times MR input rows: NR*MR independent accumulators; y has row stride ldy.
// Adjacent tiles (Far false): weight row n at w + n * K, element (m, n) to y[m * ldy + n],
// each row's line at byte offset `ahead` from the current one prefetched. Far tiles
// (stream_rows): row n at w + n * ldw, element (m, n) to y[m * ldy + n * ldn], no prefetch.
// (A template flag: the adjacent tiles' loop stays the code it was before far tiles existed.)
template <typename W, int NR, int MR, bool Far>
inline void tile(const float* x, int64_t K, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                 int64_t ahead) {
  if constexpr (!Far) ldw = K, ldn = 1;
  __m256 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      __m256 wv = load8(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  };
  constexpr int64_t L = kLine<W>;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (!Far)
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + ahead, _MM_HINT_T0);
    for (int64_t j = 0; j < L; j += 8) step(k + j);
  }
  for (; k < K; k += 8) step(k);
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) y[m * ldy + n * ldn] = hsum(acc[n][m]);
}

// fp32 weights in fp32 models (x not bf16) accumulate in double: the
// dot product rounded once, as exact as fp32 allows (an fp32 sum over K picks up an error
// that fp32 models would carry into their logits; `benchmarks/fp32_exactness.py`). Each
// element: two 4-lane double accumulators over K in order, summed at the end.
template <int NR, int MR, bool Far>
inline void tile(const float* x, int64_t K, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                 int64_t ahead) {
  if constexpr (!Far) ldw = K, ldn = 1;
  __m256d lo[NR][MR], hi[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) lo[n][m] = hi[n][m] = _mm256_setzero_pd();
  auto step = [&](int64_t k) {
    __m256d xl[MR], xh[MR];
    for (int m = 0; m < MR; ++m) {
      xl[m] = _mm256_cvtps_pd(_mm_loadu_ps(x + m * K + k));
      xh[m] = _mm256_cvtps_pd(_mm_loadu_ps(x + m * K + k + 4));
    }
    for (int n = 0; n < NR; ++n) {
      const __m256d wl = _mm256_cvtps_pd(_mm_loadu_ps(w + n * ldw + k));
      const __m256d wh = _mm256_cvtps_pd(_mm_loadu_ps(w + n * ldw + k + 4));
      for (int m = 0; m < MR; ++m) {
        lo[n][m] = _mm256_fmadd_pd(wl, xl[m], lo[n][m]);
        hi[n][m] = _mm256_fmadd_pd(wh, xh[m], hi[n][m]);
      }
    }
  };
  constexpr int64_t L = kLine<float>;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (!Far)
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + ahead, _MM_HINT_T0);
    for (int64_t j = 0; j < L; j += 8) step(k + j);
  }
  for (; k < K; k += 8) step(k);
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) {
      const __m256d v = _mm256_add_pd(lo[n][m], hi[n][m]);
      __m128d t = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
      t = _mm_add_sd(t, _mm_unpackhi_pd(t, t));
      y[m * ldy + n * ldn] = static_cast<float>(_mm_cvtsd_f64(t));
    }
}

// bf16 weights, and fp32 weights against bf16 values (a bf16 model's fp32 router): the fp32
// tile; fp32 weights in an fp32 model: the double-accumulating one.
template <typename W, int NR, int MR, bool Far>
inline void tile_of(const float* x, int64_t K, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                    int64_t ahead, bool x_bf16) {
  if constexpr (std::is_same_v<W, float>) {
    if (!x_bf16) return tile<NR, MR, Far>(x, K, w, ldw, y, ldy, ldn, ahead);
  }
  tile<W, NR, MR, Far>(x, K, w, ldw, y, ldy, ldn, ahead);
}

// NR weight rows (as in tile) against all M rows of x: 4x3 tiles reuse each loaded weight
// (4x3 vs 4x2: 104-126 vs 86-91 GFLOP/s at M = 64 and 512, benchmarks/RESULTS.md), the
// last one or two rows in a shorter tile.
template <typename W, int NR, bool Far>
inline void tile_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, float* y, int64_t ldy,
                      int64_t ldn, int64_t ahead, bool x_bf16) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_of<W, NR, 3, Far>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead, x_bf16);
  if (m + 2 <= M)
    tile_of<W, NR, 2, Far>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead, x_bf16);
  else if (m < M)
    tile_of<W, NR, 1, Far>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead, x_bf16);
}

// Weight rows [n0, n0 + kNR) (fewer at the end) against all M rows of x, each weight tile
// prefetching the next.
template <typename W>
inline void weight_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0, float* y,
                        int64_t ldy, bool x_bf16) {
  const int64_t ahead = kPrefetchRows * K * static_cast<int64_t>(sizeof(W));
  if (n0 + kNR <= N) {
    tile_rows<W, kNR, false>(x, M, K, w + n0 * K, K, y + n0, ldy, 1, ahead, x_bf16);
  } else {
    for (int64_t r = n0; r < N; ++r) tile_rows<W, 1, false>(x, M, K, w + r * K, K, y + r, ldy, 1, ahead, x_bf16);
  }
}

// Weight rows [n0, n1) (whole tiles but the last) against all M rows of x (more than
// kStreamMaxRows: fewer take stream_rows), x taken in blocks of about kXBlockBytes: each
// block stays in L2 while every weight tile of the range passes over it. Why: a tile reads
// each x row once for 2 * kNR flops per fp32 value, so streaming all of a prompt's x from L3
// (or memory) once per tile bounded the products by that traffic (AVX2 path on the AMX Xeon,
// 2048 rows: ~120 GFLOP/s, ~160 in blocks, ~172 for the tile on warm data alone;
// benchmarks/RESULTS.md, at accad50).
// Each element is its tile's sum whatever the block (one FMA chain over K, then hsum), so
// only the order in which outputs are written changes.
constexpr int64_t kXBlockBytes = 256 * 1024;
template <typename W>
inline void weight_tiles(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0, int64_t n1,
                         float* y, int64_t ldy, bool x_bf16) {
  const int64_t block = std::max<int64_t>(3, kXBlockBytes / (4 * K) / 3 * 3);  // whole 3-row tiles
  for (int64_t m0 = 0; m0 < M; m0 += block)
    for (int64_t n = n0; n < n1; n += kNR)
      weight_tile(x + m0 * K, std::min(block, M - m0), K, w, N, n, y + m0 * ldy, ldy, x_bf16);
}

// Weight rows [n0, n1) against a few rows of x, the weight read as kRowStreams sequential
// streams in lockstep: with q = (n1 - n0) / kRowStreams, step i multiplies rows n0 + i,
// n0 + q + i, n0 + 2q + i, ... (one tile whose rows are q apart; the last
// (n1 - n0) % kRowStreams rows one at a time). Each element is the tiles' sum (one 8-lane FMA
// chain over K in order, then hsum), so nothing changes but the speed. Why: one row of x
// through one weight row at a time is one FMA chain, 8 weights per FMA latency, ~15 GB/s of
// bf16 on one core even from cache; tiles of adjacent rows interleave short streams that
// the prefetchers follow badly (10-15 GB/s at 2-8 rows of x on two cores); rows far apart
// are long streams that they follow, with no software prefetch (benchmarks/RESULTS.md,
// at ab42767). Taken by products of at most kStreamMaxRows rows on these tiles (bf16 weights
// on the AVX2 path, fp32 weights on every path); from 4 rows the adjacent tiles, which
// prefetch the next tile, were as fast.
constexpr int kRowStreams = 4;
template <typename W>
inline void stream_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                        int64_t ldy, bool x_bf16) {
  const int64_t q = (n1 - n0) / kRowStreams;
  for (int64_t i = 0; i < q; ++i)
    tile_rows<W, kRowStreams, true>(x, M, K, w + (n0 + i) * K, q * K, y + n0 + i, ldy, q, 0, x_bf16);
  for (int64_t n = n0 + kRowStreams * q; n < n1; ++n) tile_rows<W, 1, true>(x, M, K, w + n * K, K, y + n, ldy, 1, 0, x_bf16);
}

}  // namespace musespark_gemv
