// AVX-512 versions of the hot loops (cpu_isa.h declares them and says when they run).
// Everything in this file is compiled for AVX-512F/BW/VL/DQ + BF16 by the pragma below and
// is reached only through musespark_isa::level() >= kAvx512Bf16. It includes no ATen or
// standard-library header after the pragma (see cpu_isa.h: no inline function compiled
// for AVX-512 may leak into the AVX2 world).
#include <cstdint>
#include <immintrin.h>
#include <type_traits>

#include "cpu_isa.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

#include "cpu_simd512.h"

using musespark_simd512::exp16;
using musespark_simd512::reachable16;

namespace musespark_avx512 {
namespace {

// ---- bf16 dot products (vdpbf16ps) -------------------------------------------------------

// Weight rows per tile, x rows per tile: 4 x 6 = 24 zmm accumulators + 4 weights + 1 x.
constexpr int kNR = 4;
constexpr int kMR = 6;
// x rows per chunk: the chunk's bf16 rows stay in L2 (~256 KiB) while every weight tile
// of the thread's slice passes over them; the weights are re-read once per chunk.
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int64_t kRowAhead = 4096;  // bytes prefetched ahead in a one-row-of-x product
constexpr int64_t kPrefetchMaxRows = 64;  // products of up to this many rows prefetch the next tile

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// The fixed lane sum of every accumulator (same code for every tile shape).
inline float sum16(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// Prefetches the weight line at p (the dot-product kernel's; the panel kernel below leaves
// its sequential stream to the hardware). `once`: no later tile of this call reads it again,
// so it is fetched non-temporally, without pushing the caller's working set (the stream, the
// interpreter's objects between calls) out of L2 and L3: a decode step reads hundreds of MiB
// of weights once each (benchmarks/RESULTS.md, session 12). Where a line lands never changes
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

// ---- bf16 panels: outer products on weight rows packed on the fly ---------------------------

namespace {

// A panel is 64 weight rows (4 blocks of 16: one zmm of outputs each) packed so that a
// 64-byte load holds one k pair of 16 rows (the layout of cpu_isa.h: a group's 16 pairs of
// block b are 16 consecutive such loads). A tile of 6 x rows broadcasts each x pair and
// multiplies it into the 4 blocks: 24 accumulators, no lane sums at the end, the packed
// panel read from L1/L2 and reused by every tile of x. Tiles of several rows fetch each of
// the 4 block streams kPanelAhead pairs ahead into L1 (T0; session 18's NTA prefetch cost
// decode 5-15 % on Zen 4); a single row does not (there it made the stream 10 % slower). On
// the Xeon measured, against session 23's layout without prefetch: 1 row 1.24x, 8 rows
// 1.06-1.10x, prompt tiles the same (benchmarks/RESULTS.md, session 24; not measured on
// Zen 4).
constexpr int kBlocks = kPanelRows / 16;
constexpr int kPanelMR = 6;
constexpr int64_t kPanelAhead = 8;

// r[i] = 16 dwords of row i -> r[j] = dword j of rows 0..15 (4 rounds of 16 shuffles).
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // b[4j + c] lane L: dword 4L + c of rows 4j..4j+3
    b[4 * j] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
    b[4 * j + 3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // transpose the 4 x 4 grid of 128-bit lanes
    const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44),
                  s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// Packs rows [0, np) of w (np <= 64, row stride K) over k in [k0, k0 + kc) into pk; rows
// past np and k past K are zeros (their products add +0: no sum changes).
inline void pack_panel(const uint16_t* w, int64_t K, int64_t np, int64_t k0, int64_t kc, uint32_t* pk) {
  for (int blk = 0; blk < kBlocks; ++blk)
    for (int64_t k = 0; k < kc; k += 32) {
      const int64_t left = kc - k;
      const __mmask32 mask = left >= 32 ? ~0u : (1u << left) - 1u;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = blk * 16 + i;
        if (row >= np) {
          r[i] = _mm512_setzero_si512();
          continue;
        }
        const uint16_t* p = w + row * K + k0 + k;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
        r[i] = _mm512_maskz_loadu_epi16(mask, p);
      }
      transpose16(r);
      const int64_t pairs = left >= 32 ? 16 : (left + 1) / 2;  // this group's (cpu_isa.h panel layout)
      uint32_t* block = pk + k / 32 * kGroupWords + 16 * pairs * blk;
      for (int64_t p = 0; p < pairs; ++p) _mm512_store_si512(block + 16 * p, r[p]);
    }
}

// MR x rows against a packed chunk of kc k: acc[m][b] (16 outputs of block b) continues from
// y (first chunk: from +0) over the pairs in order, stored back to y (exact: fp32 both).
template <int MR>
inline void panel_tile(const uint16_t* x, int64_t K, int64_t k0, int64_t kc, const uint32_t* pk, float* y,
                       int64_t ldy, const __mmask16* cols, bool first) {
  __m512 acc[MR][kBlocks];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < kBlocks; ++b)
      acc[m][b] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(cols[b], y + m * ldy + 16 * b);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x + k0);  // x pairs (K even)
  const int64_t K2 = K / 2, pairs = (kc + 1) / 2;
  // The groups of the panel layout (cpu_isa.h): whole ones (blocks kGroupWords / 4 apart),
  // then a shorter last one (gp pairs: blocks 16 gp apart).
  for (int64_t g0 = 0; g0 < pairs; g0 += kGroupPairs) {
    const bool whole = g0 + kGroupPairs <= pairs;
    const int64_t gp = whole ? kGroupPairs : pairs - g0, block = whole ? kGroupWords / kBlocks : 16 * gp;
    const uint32_t* row = pk + g0 * kPanelRows;
    const int32_t* xq = xp + g0;
    for (int64_t r = 0; r < gp; ++r, row += 16, ++xq) {
      __m512bh wv[kBlocks];
      for (int b = 0; b < kBlocks; ++b) wv[b] = (__m512bh)_mm512_load_si512(row + b * block);
      if constexpr (MR > 1)
        for (int b = 0; b < kBlocks; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(row + b * block + 16 * kPanelAhead), _MM_HINT_T0);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xq[m * K2]);
        for (int b = 0; b < kBlocks; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < kBlocks; ++b) _mm512_mask_storeu_ps(y + m * ldy + 16 * b, cols[b], acc[m][b]);
}

}  // namespace

void pack_panel_chunk(const uint16_t* w, int64_t K, int64_t np, int64_t k0, int64_t kc, uint32_t* pk) {
  pack_panel(w, K, np, k0, kc, pk);
}

void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed) {
  for (int64_t n = n0; n < n1; n += kPanelRows) {
    const int64_t np = n1 - n < kPanelRows ? n1 - n : kPanelRows;
    __mmask16 cols[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      const int64_t c = np - 16 * b;
      cols[b] = c >= 16 ? static_cast<__mmask16>(0xffff) : c <= 0 ? 0 : static_cast<__mmask16>((1u << c) - 1u);
    }
    for (int64_t k0 = 0; k0 < K; k0 += kPanelK) {
      const int64_t kc = K - k0 < kPanelK ? K - k0 : kPanelK;
      // Packed once (`packed`, ceil(N / 64) panels of K / 2 * 64 words, n0 a multiple of 64) or now.
      const uint32_t* panel = packed ? packed + n / kPanelRows * (K / 2 * kPanelRows) + k0 / 2 * kPanelRows : pk;
      if (!packed) pack_panel(w + n * K, K, np, k0, kc, pk);
      // ceil(M / 6) tiles of near-equal height (as rows_of_tile): each element's sum is the
      // same in a tile of any height.
      const int64_t tiles = (M + kPanelMR - 1) / kPanelMR;
      const int64_t base = M / tiles, taller = M % tiles;
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t h = base + (t < taller ? 1 : 0);
        const uint16_t* xt = x + m * K;
        float* yt = y + m * ldy + n;
        const bool first = k0 == 0;
        switch (h) {
          case 6: panel_tile<6>(xt, K, k0, kc, panel, yt, ldy, cols, first); break;
          case 5: panel_tile<5>(xt, K, k0, kc, panel, yt, ldy, cols, first); break;
          case 4: panel_tile<4>(xt, K, k0, kc, panel, yt, ldy, cols, first); break;
          case 3: panel_tile<3>(xt, K, k0, kc, panel, yt, ldy, cols, first); break;
          case 2: panel_tile<2>(xt, K, k0, kc, panel, yt, ldy, cols, first); break;
          default: panel_tile<1>(xt, K, k0, kc, panel, yt, ldy, cols, first); break;
        }
        m += h;
      }
    }
  }
}

// ---- NVFP4 weight-only rows ---------------------------------------------------------------

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

// y[n + r] for R rows from n with one row of x: per row, two 16-lane accumulators over the
// pairs of blocks in order (an odd last block into the first), summed at the end.
constexpr int kRows = 4;

template <int R>
inline void rows_m1(const float* xr, int64_t K, const uint8_t* codes, const uint8_t* scales, const float* const* tables,
                    int64_t rows_per_global, int64_t n, float* y) {
  const int64_t nb = K / 16, pairs = nb / 2;
  // Row r's codes, scale bytes and table; the pointers are few enough to stay in registers
  // (one table when the R rows share a global scale, as all but boundary rows do).
  const size_t cs = static_cast<size_t>(K / 2), ss = static_cast<size_t>(nb);
  const uint8_t* c = codes + n * cs;
  const uint8_t* s = scales + n * ss;
  const float* table[R];
  for (int r = 0; r < R; ++r) table[r] = tables[(n + r) / rows_per_global];
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  auto step = [&](int64_t p) {
    const __m512 xe = _mm512_loadu_ps(xr + p * 32), xo = _mm512_loadu_ps(xr + p * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const uint8_t* sr = s + r * ss + 2 * p;
      __m512 w0, w1;
      decode_pair(c + r * cs + p * 16, table[r] + (static_cast<size_t>(sr[0]) << 4),
                  table[r] + (static_cast<size_t>(sr[1]) << 4), w0, w1);
      acc0[r] = _mm512_fmadd_ps(w0, xe, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(w1, xo, acc1[r]);
    }
  };
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) {  // 4 pairs (one 64-byte line of codes per row) per prefetch
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(c + r * cs + p * 16) + 1024, _MM_HINT_T0);
      if ((p & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + r * ss + 2 * p) + 128, _MM_HINT_T0);
    }
    step(p);
    step(p + 1);
    step(p + 2);
    step(p + 3);
  }
  for (; p < pairs; ++p) step(p);
  for (int r = 0; r < R; ++r) {
    if (nb % 2 != 0)
      acc0[r] = _mm512_fmadd_ps(decode_one(c + r * cs + pairs * 16, table[r] + s[r * ss + 2 * pairs] * 16),
                                _mm512_loadu_ps(xr + pairs * 32), acc0[r]);
    y[n + r] = sum16(_mm512_add_ps(acc0[r], acc1[r]));
  }
}

}  // namespace

void nvfp4_rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / 16, pairs = nb / 2;
  const bool tail = nb % 2 != 0;
  // Decoded weight rows for M > 1 (K floats); fixed-size scratch keeps this file free of
  // library containers: rows longer than it take the one-row path per x row.
  alignas(64) static thread_local float scratch[16384];
  int64_t n = n0;
  if (M == 1) {  // four rows at a time: eight independent FMA chains (one row's two chains
    //              alone wait on the FMA latency); each row's sums are the same as below
    for (; n + kRows <= n1; n += kRows) rows_m1<kRows>(xp, K, codes, scales, tables, rows_per_global, n, y);
    for (; n < n1; ++n) rows_m1<1>(xp, K, codes, scales, tables, rows_per_global, n, y);
    return;
  }
  for (; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint8_t* s = scales + n * nb;
    const float* table = tables[n / rows_per_global];
    if (K > 16384) {
      for (int64_t m = 0; m < M; ++m) rows_m1<1>(xp + m * K, K, codes, scales, tables, rows_per_global, n, y + m * ldy);
      continue;
    }
    for (int64_t p = 0; p < pairs; ++p) {
      __m512 w0, w1;
      decode_pair(c + p * 16, table + s[2 * p] * 16, table + s[2 * p + 1] * 16, w0, w1);
      _mm512_storeu_ps(scratch + p * 32, w0);
      _mm512_storeu_ps(scratch + p * 32 + 16, w1);
    }
    if (tail) _mm512_storeu_ps(scratch + pairs * 32, decode_one(c + pairs * 16, table + s[2 * pairs] * 16));
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      __m512 a0[4], a1[4];
      for (int r = 0; r < 4; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512 w0 = _mm512_loadu_ps(scratch + p * 32), w1 = _mm512_loadu_ps(scratch + p * 32 + 16);
        for (int r = 0; r < 4; ++r) {
          a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + (m + r) * K + p * 32), a0[r]);
          a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + (m + r) * K + p * 32 + 16), a1[r]);
        }
      }
      if (tail)
        for (int r = 0; r < 4; ++r)
          a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + pairs * 32), _mm512_loadu_ps(xp + (m + r) * K + pairs * 32),
                                  a0[r]);
      for (int r = 0; r < 4; ++r) y[(m + r) * ldy + n] = sum16(_mm512_add_ps(a0[r], a1[r]));
    }
    for (; m < M; ++m) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + p * 32), _mm512_loadu_ps(xp + m * K + p * 32), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + p * 32 + 16), _mm512_loadu_ps(xp + m * K + p * 32 + 16), a1);
      }
      if (tail) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + pairs * 32), _mm512_loadu_ps(xp + m * K + pairs * 32), a0);
      y[m * ldy + n] = sum16(_mm512_add_ps(a0, a1));
    }
  }
}

}  // namespace musespark_avx512

// ---- prefill attention (bf16 q, k, v; vdpbf16ps for Q K^T and P V) ------------------------

namespace musespark_avx512 {
namespace {

// Scores of R query rows against NB consecutive blocks of 16 keys (kb: the first block's
// packed keys): s[n][r] = q_r . k over each block's 16 keys, summed over the pairs of
// dimensions in order. The NB x R sums are independent chains, so the vdpbf16ps latency
// overlaps (one block of 4 rows is 4 chains; two blocks are 8); each sum is the same.
template <int R, int NB>
__attribute__((always_inline)) inline void block_scores(const uint16_t* const* qr, const uint16_t* kb,
                                                        int64_t pairs, __m512 (&s)[2][R]) {
  for (int n = 0; n < NB; ++n)
    for (int r = 0; r < R; ++r) s[n][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh kv[NB];
    for (int n = 0; n < NB; ++n) kv[n] = (__m512bh)_mm512_loadu_si512(kb + (n * pairs + j) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t qpair;
      __builtin_memcpy(&qpair, qr[r] + 2 * j, 4);
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(qpair);
      for (int n = 0; n < NB; ++n) s[n][r] = _mm512_dpbf16_ps(s[n][r], kv[n], qv);
    }
  }
}

// R query rows (consecutive tokens of one head) x CH chunks of 16 output dimensions
// (D = 16 CH): the rows share every K and V load; their outputs stay in registers.
// Pairs of blocks of 16 keys (the last one alone) update the online softmax in order, one
// running-max update per pair; their scores are computed a pair at a time (block_scores).
template <int R, int CH>
void attend_rows(const uint16_t* q, int64_t nH, int64_t head, const uint16_t* kp, const uint16_t* vp, int64_t m,
                 int64_t q0, int64_t k0, int64_t window, float scale, int64_t t, int rows, uint16_t* out) {
  constexpr int64_t D = 16 * CH, pairs = D / 2;
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  // Keys any of these rows reaches: positions (pos - window, pos], as key indices.
  const int64_t first_pos = q0 + t, last_pos = q0 + t + rows - 1;
  int64_t k_lo = window > 0 ? first_pos - window + 1 - k0 : 0;
  if (k_lo < 0) k_lo = 0;
  int64_t k_hi = last_pos - k0 + 1;  // exclusive
  if (k_hi > m) k_hi = m;
  const uint16_t* qr[R];
  __m512 mx[R], sum[R], o[R][CH];  // running max (all lanes equal), lane-wise normalizer, output
  for (int r = 0; r < R; ++r) {
    qr[r] = q + ((t + (r < rows ? r : 0)) * nH + head) * D;
    mx[r] = neg_inf;
    sum[r] = _mm512_setzero_ps();
    for (int c = 0; c < CH; ++c) o[r][c] = _mm512_setzero_ps();
  }
  // The online softmax and P V for NB blocks from b on (one or two: 16 or 32 keys), from
  // their raw scores s: one running-max update for them all. A pair whose keys every row
  // reaches (most of them) skips the masks.
  auto update = [&](auto nb, int64_t b, const __m512 (&s)[2][R]) __attribute__((always_inline)) {
    constexpr int NB = decltype(nb)::value;
    const int64_t lo = k0 + b * 16;  // position of the first key
    const bool interior = b * 16 + 16 * NB <= m && lo + 16 * NB - 1 <= first_pos &&
                          (window == 0 || lo > last_pos - window);
    alignas(64) int32_t pp[R][8 * NB];  // each row's weights as bf16 pairs of keys
    for (int r = 0; r < R; ++r) {
      __m512 sc[NB];
      __mmask16 ok[NB];
      for (int n = 0; n < NB; ++n) sc[n] = _mm512_mul_ps(s[n][r], _mm512_set1_ps(scale)), ok[n] = 0xFFFF;
      if (!interior) {
        const int64_t pos = q0 + t + r;
        __mmask16 any = 0;
        for (int n = 0; n < NB; ++n) {
          ok[n] = r < rows ? reachable16(lo + 16 * n, pos, k0 + m, window) : 0;
          sc[n] = _mm512_mask_mov_ps(neg_inf, ok[n], sc[n]);
          any |= ok[n];
        }
        if (any == 0) {  // no key here for this row: its state stays as it is (weights 0)
          for (int n = 0; n < NB; ++n) _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r] + 8 * n), _mm256_setzero_si256());
          continue;
        }
      }
      const __m512 top = NB == 2 ? _mm512_max_ps(sc[0], sc[NB - 1]) : sc[0];
      // The running max stands unless some lane exceeds it (before the first key it is
      // -inf, which every reachable key exceeds); then it rises to these keys' max and the
      // row's sums are scaled by exp(old - new).
      if (_mm512_cmp_ps_mask(top, mx[r], _CMP_GT_OQ) != 0) {
        const __m512 nmax = _mm512_max_ps(mx[r], _mm512_set1_ps(_mm512_reduce_max_ps(top)));
        const __m512 corr = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx[r], neg_inf, _CMP_NEQ_OQ),
                                                exp16(_mm512_sub_ps(mx[r], nmax)));
        sum[r] = _mm512_mul_ps(sum[r], corr);
        for (int c = 0; c < CH; ++c) o[r][c] = _mm512_mul_ps(o[r][c], corr);
        mx[r] = nmax;
      }
      for (int n = 0; n < NB; ++n) {  // P in bf16 for the P V product (as flash attention)
        const __m256bh pb = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(ok[n], exp16(_mm512_sub_ps(sc[n], mx[r]))));
        sum[r] = _mm512_add_ps(sum[r], _mm512_cvtpbh_ps(pb));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r] + 8 * n), (__m256i)pb);
      }
    }
    const uint16_t* vb = vp + b * 8 * D * 2;  // these blocks' 8 NB key pairs
    for (int i = 0; i < 8 * NB; ++i) {
      __m512bh pv[R];
      for (int r = 0; r < R; ++r) pv[r] = (__m512bh)_mm512_set1_epi32(pp[r][i]);
      for (int c = 0; c < CH; ++c) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + (i * CH + c) * 32);
        for (int r = 0; r < R; ++r) o[r][c] = _mm512_dpbf16_ps(o[r][c], vv, pv[r]);
      }
    }
  };
  const int64_t b_end = (k_hi + 15) / 16;
  int64_t b = k_lo / 16;
  for (; b + 1 < b_end; b += 2) {
    __m512 s[2][R];
    block_scores<R, 2>(qr, kp + b * pairs * 32, pairs, s);
    update(std::integral_constant<int, 2>{}, b, s);
  }
  if (b < b_end) {
    __m512 s[2][R];
    block_scores<R, 1>(qr, kp + b * pairs * 32, pairs, s);
    update(std::integral_constant<int, 1>{}, b, s);
  }
  for (int r = 0; r < rows; ++r) {
    const float total = _mm512_reduce_add_ps(sum[r]);
    const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);  // no reachable key: zeros
    uint16_t* dst = out + ((t + r) * nH + head) * D;
    for (int c = 0; c < CH; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], inv)));
  }
}

template <int R, int CH>
void attend_all(const uint16_t* q, int64_t nH, int64_t head, const uint16_t* kp, const uint16_t* vp, int64_t m,
                int64_t q0, int64_t k0, int64_t window, float scale, int64_t t0, int64_t t1, uint16_t* out) {
  for (int64_t t = t0; t < t1; t += R)
    attend_rows<R, CH>(q, nH, head, kp, vp, m, q0, k0, window, scale, t, static_cast<int>(t1 - t < R ? t1 - t : R),
                       out);
}

}  // namespace

void prefill_attention_rows(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                            const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                            int64_t t0, int64_t t1, uint16_t* out) {
  switch (D) {  // registers: R * CH output vectors plus R scores, max and sum vectors
    case 16: return attend_all<4, 1>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 32: return attend_all<4, 2>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 48: return attend_all<4, 3>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 64: return attend_all<4, 4>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 80: return attend_all<2, 5>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 96: return attend_all<2, 6>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 112: return attend_all<2, 7>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    case 128: return attend_all<2, 8>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
    default: return attend_all<1, 16>(q, nH, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);  // 256
  }
}

}  // namespace musespark_avx512

// ---- decode attention (one query per sequence, bf16 paged cache) --------------------------

namespace musespark_avx512 {
namespace {

// Sums of 16 lanes: c[0:8] = a[lo] + a[hi] halves' pairs chosen by `lo` (indices into a|b),
// the matching `lo + step` lanes added.
inline __m512 fold(__m512 a, __m512 b, __m512i lo, int step) {
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b),
                       _mm512_permutex2var_ps(a, _mm512_add_epi32(lo, _mm512_set1_epi32(step)), b));
}

// Lane i of the result = the sum of v[i]'s 16 lanes, by a fixed tree of halvings (8, 4, 2,
// 1 lanes); v[0..15] is clobbered.
inline __m512 lane_sums(__m512* v) {
  const __m512i h8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i h4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i h2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i h1 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  for (int i = 0; i < 8; ++i) v[i] = fold(v[2 * i], v[2 * i + 1], h8, 8);  // v[i]: sums of 2i | 2i+1
  for (int i = 0; i < 4; ++i) v[i] = fold(v[2 * i], v[2 * i + 1], h4, 4);
  for (int i = 0; i < 2; ++i) v[i] = fold(v[2 * i], v[2 * i + 1], h2, 2);
  return fold(v[0], v[1], h1, 1);
}

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxHeads = 1024;  // query heads of a sequence (nh * G)
alignas(64) const uint16_t kZeroRow[kMaxHeadDim] = {};  // the key past the last (scores unused)

// Each pass streams its rows (K, then V: the nh heads' rows of a slot are adjacent) and
// prefetches them this many slots ahead, a DRAM latency's worth of the loop; slots within a
// block are adjacent, blocks anywhere.
constexpr int64_t kKeysAhead = 32;
// The P V pass takes the keys in chunks of this many slots, every head over one chunk
// before the next (the chunk's value rows stay in L1); each head's sums still run over the
// keys in order, kept in `out` between chunks.
constexpr int64_t kValueChunk = 32;

inline void prefetch_row(const uint16_t* p, int64_t bytes, int hint) {
#pragma GCC unroll 8
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, static_cast<_mm_hint>(hint));
}

// One step of keys (KJ = 16 / GH rows, n of them real) against GH query heads: 16
// accumulators (one per head and key), each a vdpbf16ps dot product over D in order, reduced
// together by lane_sums. Every score is computed the same way whatever GH, KJ or the step.
template <int GH>
inline void score_step(const uint16_t* q, int64_t D, const uint16_t* const* row, int64_t n, float scale, float* scores,
                       int64_t lds) {
  constexpr int KJ = 16 / GH;
  __m512 acc[16];
  for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32)
    for (int j = 0; j < KJ; ++j) {
      const __m512bh kv = load_bh(row[j] + c);
      for (int g = 0; g < GH; ++g) acc[g * KJ + j] = _mm512_dpbf16_ps(acc[g * KJ + j], load_bh(q + g * D + c), kv);
    }
  // Lanes [g KJ, g KJ + n) are head g's scores: one masked store each (the base may point
  // before the row; masked-off lanes are never accessed).
  const __m512 got = _mm512_mul_ps(lane_sums(acc), _mm512_set1_ps(scale));
  const __mmask16 first = static_cast<__mmask16>((1u << n) - 1u);
  for (int g = 0; g < GH; ++g)
    _mm512_mask_storeu_ps(scores + g * lds - g * KJ, static_cast<__mmask16>(first << (g * KJ)), got);
}

// Scores of nh KV heads' G query heads each (GH at a time), the keys in steps of 16 / GH
// and, within a step, every head: the nh heads' rows of a slot are adjacent, so the keys are
// read as one stream.
template <int GH>
void scores_all(const uint16_t* q, int64_t nh, int64_t G, int64_t D, const uint16_t* k, const uint16_t* v,
                int64_t stride, const int64_t* slots, int64_t L, float scale, float* scores) {
  constexpr int KJ = 16 / GH;
  for (int64_t i0 = 0; i0 < L; i0 += KJ) {
    const int64_t n = L - i0 < KJ ? L - i0 : KJ;
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t j = 0; j < n; ++j)  // this head's part only: prefetches spread over the step
        if (i0 + j + kKeysAhead < L) {
          prefetch_row(k + slots[i0 + j + kKeysAhead] * stride + h * D, 2 * D, _MM_HINT_T0);
          // the value rows, into L2 for the second pass
          prefetch_row(v + slots[i0 + j + kKeysAhead] * stride + h * D, 2 * D, _MM_HINT_T1);
        }
      const uint16_t* row[KJ];
      for (int64_t j = 0; j < KJ; ++j) row[j] = j < n ? k + slots[i0 + j] * stride + h * D : kZeroRow;
      for (int64_t g = 0; g < G; g += GH)
        score_step<GH>(q + (h * G + g) * D, D, row, n, scale, scores + (h * G + g) * L + i0, L);
    }
  }
}

// GH heads x DV vectors of 16 output dimensions: out += p[g, i] * v_i over keys [i0, i1)
// in order (out holds the sums over the keys before i0). Each 32 values of a row are widened
// by interleaving zeros (bf16 is the top half of an fp32), which leaves each 16-lane vector
// holding every other group of 4 dims: out keeps that order until decode_attention puts the
// dims back. With `prefetch`, the same columns of the next chunk's rows (up to key L) are
// prefetched, one row per key.
template <int GH, int DV>
void values_group(const float* p, int64_t ldp, int64_t i0, int64_t i1, const uint16_t* v, int64_t stride,
                  const int64_t* slots, float* out, int64_t ldo, bool prefetch, int64_t L) {
  __m512 acc[GH][DV];
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_loadu_ps(out + g * ldo + 16 * c);
  for (int64_t i = i0; i < i1; ++i) {
    if (prefetch && i + kValueChunk < L) prefetch_row(v + slots[i + kValueChunk] * stride, 32 * DV, _MM_HINT_T0);
    const uint16_t* row = v + slots[i] * stride;
    __m512 vf[DV];
    for (int c = 0; c < DV; c += 2) {  // 32 values: dims 0-3, 8-11, .. | 4-7, 12-15, .. of the 32
      const __m512i raw = _mm512_loadu_si512(row + 16 * c);
      vf[c] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), raw));
      vf[c + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), raw));
    }
    for (int g = 0; g < GH; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ldp + i]);
      for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out + g * ldo + 16 * c, acc[g][c]);
}

// s[0:L] <- exp(s - max s) (16 lanes, exp16); returns 1 / their sum (16 lane sums over the
// keys in order, then a fixed tree).
inline float softmax_unnormalized(float* s, int64_t L) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  __m512 mv = neg_inf;
  for (int64_t i = 0; i < L; i += 16) {
    const __mmask16 m = L - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - i)) - 1u);
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(neg_inf, m, s + i));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < L; i += 16) {
    const __mmask16 m = L - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - i)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx)));
    _mm512_mask_storeu_ps(s + i, m, e);
    total = _mm512_add_ps(total, e);
  }
  return 1.f / _mm512_reduce_add_ps(total);
}

}  // namespace

bool decode_attention_fits(int64_t D, int64_t H) { return D % 32 == 0 && D <= kMaxHeadDim && H <= kMaxHeads; }

void decode_attention(const uint16_t* q, int64_t nh, int64_t G, int64_t D, const uint16_t* k, const uint16_t* v,
                      int64_t stride, const int64_t* slots, int64_t L, float scale, float* scores, float* out) {
  if (G % 4 == 0)
    scores_all<4>(q, nh, G, D, k, v, stride, slots, L, scale, scores);
  else if (G % 2 == 0)
    scores_all<2>(q, nh, G, D, k, v, stride, slots, L, scale, scores);
  else
    scores_all<1>(q, nh, G, D, k, v, stride, slots, L, scale, scores);
  const int64_t H = nh * G;  // query heads; scores [H, L], out [H, D]
  float inv[kMaxHeads];
  for (int64_t r = 0; r < H; ++r) inv[r] = softmax_unnormalized(scores + r * L, L);
  for (int64_t i = 0; i < H * D; ++i) out[i] = 0.f;
  for (int64_t i0 = 0; i0 < L; i0 += kValueChunk) {
    const int64_t i1 = i0 + kValueChunk < L ? i0 + kValueChunk : L;
    for (int64_t h = 0; h < nh; ++h) {
      const float* ph = scores + h * G * L;
      const uint16_t* vh = v + h * D;
      float* oh = out + h * G * D;
      for (int64_t g = 0; g < G; g += 4) {
        const int64_t gh = G - g < 4 ? G - g : 4;
        for (int64_t d = 0; d < D; d += 64) {
          const float* pg = ph + g * L;
          float* og = oh + g * D + d;
          const bool wide = d + 64 <= D;  // else D % 64 == 32: two vectors
          if (gh == 4) {
            if (wide) values_group<4, 4>(pg, L, i0, i1, vh + d, stride, slots, og, D, g == 0, L);
            else values_group<4, 2>(pg, L, i0, i1, vh + d, stride, slots, og, D, g == 0, L);
            continue;
          }
          for (int64_t e = 0; e < gh; ++e) {
            if (wide) values_group<1, 4>(pg + e * L, L, i0, i1, vh + d, stride, slots, og + e * D, D, g + e == 0, L);
            else values_group<1, 2>(pg + e * L, L, i0, i1, vh + d, stride, slots, og + e * D, D, g + e == 0, L);
          }
        }
      }
    }
  }
  // Each 32 dims were summed as [lo | hi] halves (values_group's interleaving): back in order.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < H; ++r)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 lo = _mm512_loadu_ps(out + r * D + d), hi = _mm512_loadu_ps(out + r * D + d + 16);
      const __m512 scale = _mm512_set1_ps(inv[r]);
      _mm512_storeu_ps(out + r * D + d, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
      _mm512_storeu_ps(out + r * D + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
    }
}

}  // namespace musespark_avx512
