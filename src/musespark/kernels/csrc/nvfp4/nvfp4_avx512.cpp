// NVFP4 weight rows on AVX-512: musespark_avx512::nvfp4_rows (nvfp4/nvfp4.h; nvfp4/nvfp4_linear.cpp
// states the numerics).
// Compiled for AVX-512F/BW/VL/DQ (no BF16: the avx512 path runs it too) by the pragma below
// and reached only through the dispatch table (common/dispatch.h) on paths whose CPU runs it.
// No ATen or standard-library header after the pragma (common/isa.h: no inline function
// compiled for AVX-512 may leak into the AVX2 world).
#include <cstdint>
#include <immintrin.h>

#include "nvfp4.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

#include "../common/simd512.h"

namespace musespark_avx512 {

using musespark_simd512::sum16;

namespace {

// Two blocks (32 weights, 16 code bytes): lanes 0-7 block a, 8-15 block b. The low nibble
// of byte j is element 2j, the high nibble element 2j+1; vpermi2ps reads 5 index bits: bit
// 4 picks block b's table. w0 = [a even | b even], w1 = [a odd | b odd].
inline void decode_pair(const uint8_t* codes, const float* table_a, const float* table_b, __m512& w0,
                        __m512& w1) {
  const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512i which = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
  const __m512 ta = _mm512_loadu_ps(table_a), tb = _mm512_loadu_ps(table_b);
  // (raw & 15) | which, in one ternary-logic op (0xEA = (A & B) | C).
  const __m512i lo = _mm512_ternarylogic_epi32(raw, _mm512_set1_epi32(15), which, 0xEA);
  const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(raw, 4), which);
  w0 = _mm512_permutex2var_ps(ta, lo, tb);
  w1 = _mm512_permutex2var_ps(ta, hi, tb);
}

// One block (16 weights, 8 code bytes), the tail of a row whose K is an odd number of
// blocks: w = [even | odd].
inline __m512 decode_one(const uint8_t* codes, const float* table) {
  const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi32(raw, 4), 1);
  return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(table));  // reads index bits 0-3
}

// y[m * ldy + n + r] for R weight rows from n and MR rows of x (MR <= 4): each pair of blocks
// decoded once in registers and multiplied into every x row; per (m, r) two 16-lane
// accumulators over the pairs of blocks in order (an odd last block into the first), summed
// at the end: the same sums whatever MR.
constexpr int kRows = 4;
constexpr int kSmallM = 4;  // up to this many x rows: this product; more: the tiled one below

template <int R, int MR>
inline void rows_small_m(const float* xp, int64_t K, const uint8_t* codes, const uint8_t* scales,
                         const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n, float* y) {
  const int64_t nb = K / 16, pairs = nb / 2;
  // Row r's codes, scale bytes and table; the pointers are few enough to stay in registers
  // (one table when the R rows share a global scale, as all but boundary rows do).
  const size_t cs = static_cast<size_t>(K / 2), ss = static_cast<size_t>(nb);
  const uint8_t* c = codes + n * cs;
  const uint8_t* s = scales + n * ss;
  const float* table[R];
  for (int r = 0; r < R; ++r) table[r] = tables[(n + r) / rows_per_global];
  __m512 acc0[R][MR], acc1[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc0[r][m] = acc1[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t p) {
    __m512 xe[MR], xo[MR];
    for (int m = 0; m < MR; ++m) {
      xe[m] = _mm512_loadu_ps(xp + m * K + p * 32);
      xo[m] = _mm512_loadu_ps(xp + m * K + p * 32 + 16);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* sr = s + r * ss + 2 * p;
      __m512 w0, w1;
      decode_pair(c + r * cs + p * 16, table[r] + (static_cast<size_t>(sr[0]) << 4),
                  table[r] + (static_cast<size_t>(sr[1]) << 4), w0, w1);
      for (int m = 0; m < MR; ++m) {
        acc0[r][m] = _mm512_fmadd_ps(w0, xe[m], acc0[r][m]);
        acc1[r][m] = _mm512_fmadd_ps(w1, xo[m], acc1[r][m]);
      }
    }
  };
  int64_t p = 0;
  // 4 pairs (one 64-byte line of codes per row) per prefetch, of the same line of the next R
  // rows (nvfp4/nvfp4.h: rows_ahead).
  for (; p + 4 <= pairs; p += 4) {
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(c + (r + R) * cs + p * 16), _MM_HINT_T0);
      if ((p & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + (r + R) * ss + 2 * p), _MM_HINT_T0);
    }
    step(p);
    step(p + 1);
    step(p + 2);
    step(p + 3);
  }
  for (; p < pairs; ++p) step(p);
  for (int r = 0; r < R; ++r) {
    const __m512 wt = nb % 2 != 0 ? decode_one(c + r * cs + pairs * 16, table[r] + s[r * ss + 2 * pairs] * 16)
                                  : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      if (nb % 2 != 0) acc0[r][m] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(xp + m * K + pairs * 32), acc0[r][m]);
      y[m * ldy + n + r] = sum16(_mm512_add_ps(acc0[r][m], acc1[r][m]));
    }
  }
}

template <int MR>
inline void small_m(const float* xp, int64_t K, const uint8_t* codes, const uint8_t* scales,
                    const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1,
                    float* y) {
  // MR = 1: four weight rows at a time (eight independent FMA chains: one row's two chains
  // alone wait on the FMA latency); more x rows bring chains of their own, and fewer weight
  // rows keep the accumulators in registers
  constexpr int R = MR <= 2 ? kRows : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_small_m<R, MR>(xp, K, codes, scales, tables, rows_per_global, ldy, n, y);
  for (; n < n1; ++n) rows_small_m<1, MR>(xp, K, codes, scales, tables, rows_per_global, ldy, n, y);
}

// Rows of x against weight rows decoded once: the M > 4 products (a prompt; a batch's rows
// that chose the same expert). NR weight rows at a time are decoded kChunkPairs pairs of blocks
// at a time into the thread's scratch (L1), and every x row is multiplied by them in register
// tiles of NR weight rows by MR x rows, FMA-bound instead of decode-bound. Each (m, n) keeps
// the M = 1 path's two accumulators, parked in `acc` between chunks, so its sums are those of
// rows_small_m in the same order: the same bits whatever M.
constexpr int kNR = 4;
constexpr int kMR = 3;
constexpr int64_t kChunkPairs = 32;  // 1024 weights per row: NR rows of decoded fp32 = 16 KiB

template <int NR, int MR>
inline void tile_chunk(const float* xp, int64_t K, int64_t p0, int64_t np, const float* w, float* acc) {
  __m512 a0[NR][MR], a1[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      a0[r][m] = _mm512_loadu_ps(acc + (m * kNR + r) * 32);
      a1[r][m] = _mm512_loadu_ps(acc + (m * kNR + r) * 32 + 16);
    }
  for (int64_t p = 0; p < np; ++p) {
    __m512 xe[MR], xo[MR];
    for (int m = 0; m < MR; ++m) {
      xe[m] = _mm512_loadu_ps(xp + m * K + (p0 + p) * 32);
      xo[m] = _mm512_loadu_ps(xp + m * K + (p0 + p) * 32 + 16);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 w0 = _mm512_load_ps(w + (r * kChunkPairs + p) * 32), w1 = _mm512_load_ps(w + (r * kChunkPairs + p) * 32 + 16);
      for (int m = 0; m < MR; ++m) {
        a0[r][m] = _mm512_fmadd_ps(w0, xe[m], a0[r][m]);
        a1[r][m] = _mm512_fmadd_ps(w1, xo[m], a1[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      _mm512_storeu_ps(acc + (m * kNR + r) * 32, a0[r][m]);
      _mm512_storeu_ps(acc + (m * kNR + r) * 32 + 16, a1[r][m]);
    }
}

// Weight rows [n, n + NR) against the M rows of x.
template <int NR>
inline void rows_tiled(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                       const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n, float* y,
                       float* w, float* acc) {
  const int64_t nb = K / 16, pairs = nb / 2;
  const size_t cs = static_cast<size_t>(K / 2), ss = static_cast<size_t>(nb);
  const float* table[NR];
  for (int r = 0; r < NR; ++r) table[r] = tables[(n + r) / rows_per_global];
  for (int64_t i = 0; i < M * kNR * 32; ++i) acc[i] = 0.f;
  auto run = [&](int64_t x_row, int rows, int64_t p0, int64_t np) {
    float* a = acc + x_row * kNR * 32;
    const float* x = xp + x_row * K;
    switch (rows) {
      case 3: tile_chunk<NR, 3>(x, K, p0, np, w, a); break;
      case 2: tile_chunk<NR, 2>(x, K, p0, np, w, a); break;
      default: tile_chunk<NR, 1>(x, K, p0, np, w, a); break;
    }
  };
  for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
    const int64_t np = pairs - p0 < kChunkPairs ? pairs - p0 : kChunkPairs;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* c = codes + (n + r) * cs;
      const uint8_t* s = scales + (n + r) * ss;
      for (int64_t p = 0; p < np; ++p) {
        __m512 w0, w1;
        const int64_t q = p0 + p;
        decode_pair(c + q * 16, table[r] + s[2 * q] * 16, table[r] + s[2 * q + 1] * 16, w0, w1);
        _mm512_store_ps(w + (r * kChunkPairs + p) * 32, w0);
        _mm512_store_ps(w + (r * kChunkPairs + p) * 32 + 16, w1);
      }
    }
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR) run(m, kMR, p0, np);
    if (m < M) run(m, static_cast<int>(M - m), p0, np);
  }
  for (int r = 0; r < NR; ++r) {
    const uint8_t* c = codes + (n + r) * cs;
    const uint8_t* s = scales + (n + r) * ss;
    const __m512 wt = nb % 2 != 0 ? decode_one(c + pairs * 16, table[r] + s[2 * pairs] * 16) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; ++m) {
      __m512 a0 = _mm512_loadu_ps(acc + (m * kNR + r) * 32);
      const __m512 a1 = _mm512_loadu_ps(acc + (m * kNR + r) * 32 + 16);
      if (nb % 2 != 0) a0 = _mm512_fmadd_ps(wt, _mm512_loadu_ps(xp + m * K + pairs * 32), a0);
      y[m * ldy + n + r] = sum16(_mm512_add_ps(a0, a1));
    }
  }
}

}  // namespace

void nvfp4_rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y) {
  switch (M <= kSmallM ? M : 0) {  // each row's sums are the same in every product
    case 1: return small_m<1>(xp, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    case 2: return small_m<2>(xp, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    case 3: return small_m<3>(xp, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    case 4: return small_m<4>(xp, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    default: break;
  }
  const int64_t n = n0;
  // The decoded chunk of kNR rows and the parked accumulators of up to kMaxRows x rows; fixed
  // sizes keep this file free of library containers. More rows of x are taken kMaxRows at a time.
  constexpr int64_t kMaxRows = 256;
  alignas(64) static thread_local float w[kNR * kChunkPairs * 32];
  alignas(64) static thread_local float acc[kMaxRows * kNR * 32];
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t mb = M - m0 < kMaxRows ? M - m0 : kMaxRows;
    const float* x = xp + m0 * K;
    float* ym = y + m0 * ldy;
    int64_t r = n;
    for (; r + kNR <= n1; r += kNR) rows_tiled<kNR>(x, mb, K, codes, scales, tables, rows_per_global, ldy, r, ym, w, acc);
    for (; r < n1; ++r) rows_tiled<1>(x, mb, K, codes, scales, tables, rows_per_global, ldy, r, ym, w, acc);
  }
}

}  // namespace musespark_avx512
