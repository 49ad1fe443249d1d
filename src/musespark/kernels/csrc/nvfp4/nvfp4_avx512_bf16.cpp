// NVFP4 weight rows times bf16 x on AVX-512-BF16: musespark_avx512::nvfp4_rows_bf16 (nvfp4/nvfp4.h;
// nvfp4/nvfp4_linear.cpp states the numerics). Paths with bf16 hardware run it for products
// whose x holds bf16 values (the decoded weights are then bf16 values too, as the reference
// rounds them); with an fp32 x they keep musespark_avx512::nvfp4_rows.
//
// The weights are decoded straight to bf16 (every decoded weight is a bf16 value when x is
// one, the reference rounds it so): a 32-word vpermw over the bf16 twins of the two blocks'
// magnitude tables, in the natural element order, so x arrives as its own bf16 bits, unpermuted,
// and one vdpbf16ps multiplies 32 weights by 32 x values where the fp32 rows need two FMAs
// after a decode of two permutes. The products are exact in fp32 either way; the sums differ
// from the fp32 rows' in order: per row one 16-lane accumulator, lane i adding the products
// of elements 2i and 2i + 1 of every pair of blocks in turn (vdpbf16ps: bf16 inputs below
// 2^-126 read as zero, which no bf16 activation or decoded weight is in practice), a last odd
// block through the same instruction with its upper half zero, then the 16 lanes summed.
//
// Products of up to 4 rows of x decode each pair of blocks once in registers and multiply it
// into every x row; more rows decode each weight tile once into L1 as bf16 and multiply it into
// every x row in register tiles. Every (m, n) keeps one accumulator in the same order, so its
// bits are the one-row path's whatever M.
//
// Compiled for AVX-512F/BW/VL/DQ + BF16 by the pragma below and reached only through the
// dispatch table (common/dispatch.h) on paths whose CPU runs it. No ATen or standard-library
// header after the pragma (common/isa.h).
#include <cstdint>
#include <immintrin.h>

#include "nvfp4.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

#include "../common/simd512.h"

namespace musespark_avx512 {

using musespark_simd512::load_bh;
using musespark_simd512::sum16;

namespace {

// A table's bf16 twin (nvfp4/nvfp4_tables.h: after the 4096 fp32 values of a pairs table
// built for bf16 x, the same values as bf16 bits): 16 words per scale byte.
inline const uint16_t* bf16_twin(const float* table) { return reinterpret_cast<const uint16_t*>(table + 256 * 16); }

// Two blocks (32 weights, 16 code bytes) as 32 bf16 in the natural order, from the twins'
// 16-word rows of their scale bytes. Dword j gets code byte j's low nibble in its low word
// (element 2j) and its high nibble in its high word (element 2j + 1): (b | b << 12) &
// 0x000F000F; bit 4 of every word of block b's dwords (8-15) picks the second table of the
// 32-word vpermw table.
inline __m512i decode_pair16(const uint8_t* codes, const uint16_t* ta, const uint16_t* tb) {
  const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  // 0xA8: (A | B) & C
  __m512i idx = _mm512_ternarylogic_epi32(raw, _mm512_slli_epi32(raw, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  idx = _mm512_mask_or_epi32(idx, 0xFF00, idx, _mm512_set1_epi32(0x00100010));
  const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ta))),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)), 1);
  return _mm512_permutexvar_epi16(idx, t);
}

// A last odd block (16 weights, 8 code bytes) as 16 bf16 in the natural order in words 0-15,
// zeros above.
inline __m512i decode_one16(const uint8_t* codes, const uint16_t* t) {
  const __m512i raw = _mm512_maskz_cvtepu8_epi32(0x00FF, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m512i idx = _mm512_ternarylogic_epi32(raw, _mm512_slli_epi32(raw, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  const __m256i table = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t));
  return _mm512_maskz_mov_epi32(0x00FF, _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(table)));
}

// y[m * ldy + n + r] for R weight rows from n and MR rows of x (bf16 bits, MR <= 4): each
// pair of blocks decoded once in registers and multiplied into every x row; every (m, r) keeps
// its own accumulator, added to in the order of the one-row product, so the bits do not depend
// on MR.
constexpr int kRows = 4;
constexpr int kSmallM = 4;  // up to this many x rows: this product; more: the tiled one below

template <int R, int MR>
inline void rows_small_m(const uint16_t* xb, int64_t K, const uint8_t* codes, const uint8_t* scales,
                         const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n, float* y) {
  const int64_t nb = K / 16, pairs = nb / 2;
  const size_t cs = static_cast<size_t>(K / 2), ss = static_cast<size_t>(nb);
  const uint8_t* c = codes + n * cs;
  const uint8_t* s = scales + n * ss;
  const uint16_t* table[R];
  for (int r = 0; r < R; ++r) table[r] = bf16_twin(tables[(n + r) / rows_per_global]);
  __m512 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t p) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_bh(xb + m * K + p * 32);
    for (int r = 0; r < R; ++r) {
      const uint8_t* sr = s + r * ss + 2 * p;
      const __m512i w = decode_pair16(c + r * cs + p * 16, table[r] + (static_cast<size_t>(sr[0]) << 4),
                                      table[r] + (static_cast<size_t>(sr[1]) << 4));
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)w, xv[m]);
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
    const uint8_t* last = c + r * cs + pairs * 16;
    const __m512bh wt = (__m512bh)(nb % 2 != 0 ? decode_one16(last, table[r] + s[r * ss + 2 * pairs] * 16)
                                               : _mm512_setzero_si512());
    for (int m = 0; m < MR; ++m) {
      if (nb % 2 != 0) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wt, load_bh(xb + m * K + pairs * 32, 0xFFFFu));
      y[m * ldy + n + r] = sum16(acc[r][m]);
    }
  }
}

template <int MR>
inline void small_m(const uint16_t* xb, int64_t K, const uint8_t* codes, const uint8_t* scales,
                    const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1,
                    float* y) {
  // MR = 1: four weight rows at a time (four independent vdpbf16ps chains); more x rows bring
  // chains of their own, and fewer weight rows keep the accumulators in registers
  constexpr int R = MR == 1 ? kRows : MR == 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_small_m<R, MR>(xb, K, codes, scales, tables, rows_per_global, ldy, n, y);
  for (; n < n1; ++n) rows_small_m<1, MR>(xb, K, codes, scales, tables, rows_per_global, ldy, n, y);
}

// The M > 1 products: NR weight rows decoded kChunkPairs pairs of blocks at a time into the
// thread's scratch (bf16, 64 bytes a pair), multiplied into MR x rows at a time.
constexpr int kNR = 4;
constexpr int kMR = 4;
constexpr int64_t kChunkPairs = 64;  // 2048 weights per row: NR rows of bf16 = 16 KiB

template <int NR, int MR>
inline void tile_chunk(const uint16_t* xb, int64_t K, int64_t p0, int64_t np, const uint16_t* w, float* acc) {
  __m512 a[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) a[r][m] = _mm512_loadu_ps(acc + (m * kNR + r) * 16);
  for (int64_t p = 0; p < np; ++p) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_bh(xb + m * K + (p0 + p) * 32);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = load_bh(w + (r * kChunkPairs + p) * 32);
      for (int m = 0; m < MR; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc + (m * kNR + r) * 16, a[r][m]);
}

// Weight rows [n, n + NR) against the M rows of x.
template <int NR>
inline void rows_tiled(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                       const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n, float* y,
                       uint16_t* w, float* acc) {
  const int64_t nb = K / 16, pairs = nb / 2;
  const size_t cs = static_cast<size_t>(K / 2), ss = static_cast<size_t>(nb);
  const uint16_t* table[NR];
  for (int r = 0; r < NR; ++r) table[r] = bf16_twin(tables[(n + r) / rows_per_global]);
  for (int64_t i = 0; i < M * kNR * 16; ++i) acc[i] = 0.f;
  auto run = [&](int64_t x_row, int rows, int64_t p0, int64_t np) {
    float* a = acc + x_row * kNR * 16;
    const uint16_t* x = xb + x_row * K;
    switch (rows) {
      case 4: tile_chunk<NR, 4>(x, K, p0, np, w, a); break;
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
        const int64_t q = p0 + p;
        // the same row's next chunk, a line of codes per 4 pairs (the rows of NR streams: the
        // hardware prefetchers do not follow them)
        if ((p & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(c + (q + kChunkPairs) * 16), _MM_HINT_T0);
        if ((p & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + 2 * (q + kChunkPairs)), _MM_HINT_T0);
        _mm512_store_si512(w + (r * kChunkPairs + p) * 32,
                           decode_pair16(c + q * 16, table[r] + s[2 * q] * 16, table[r] + s[2 * q + 1] * 16));
      }
    }
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR) run(m, kMR, p0, np);
    if (m < M) run(m, static_cast<int>(M - m), p0, np);
  }
  for (int r = 0; r < NR; ++r) {
    const uint8_t* c = codes + (n + r) * cs;
    const uint8_t* s = scales + (n + r) * ss;
    const __m512bh wt = (__m512bh)(nb % 2 != 0 ? decode_one16(c + pairs * 16, table[r] + s[2 * pairs] * 16)
                                               : _mm512_setzero_si512());
    for (int64_t m = 0; m < M; ++m) {
      __m512 a = _mm512_loadu_ps(acc + (m * kNR + r) * 16);
      if (nb % 2 != 0) a = _mm512_dpbf16_ps(a, wt, load_bh(xb + m * K + pairs * 32, 0xFFFFu));
      y[m * ldy + n + r] = sum16(a);
    }
  }
}

}  // namespace

void nvfp4_rows_bf16(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                     const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1,
                     float* y) {
  switch (M <= kSmallM ? M : 0) {
    case 1: return small_m<1>(xb, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    case 2: return small_m<2>(xb, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    case 3: return small_m<3>(xb, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    case 4: return small_m<4>(xb, K, codes, scales, tables, rows_per_global, ldy, n0, n1, y);
    default: break;
  }
  const int64_t n = n0;
  // The decoded chunk of kNR rows and the parked accumulators of up to kMaxRows x rows (fixed
  // sizes keep this file free of library containers); more rows of x are taken kMaxRows at a
  // time, and fewer where K is long, so that a block of x (bf16) stays within about 512 KiB of L2.
  constexpr int64_t kMaxRows = 256;
  alignas(64) static thread_local uint16_t w[kNR * kChunkPairs * 32];
  alignas(64) static thread_local float acc[kMaxRows * kNR * 16];
  int64_t block = (int64_t{256} << 10) / K;  // rows of 2K bytes in 512 KiB
  block = block < 16 ? 16 : block > kMaxRows ? kMaxRows : block;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t mb = M - m0 < block ? M - m0 : block;
    const uint16_t* x = xb + m0 * K;
    float* ym = y + m0 * ldy;
    int64_t r = n;
    for (; r + kNR <= n1; r += kNR)
      rows_tiled<kNR>(x, mb, K, codes, scales, tables, rows_per_global, ldy, r, ym, w, acc);
    for (; r < n1; ++r) rows_tiled<1>(x, mb, K, codes, scales, tables, rows_per_global, ldy, r, ym, w, acc);
  }
}

}  // namespace musespark_avx512
