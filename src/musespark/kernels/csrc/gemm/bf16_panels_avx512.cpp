// The panel kernel on AVX-512-BF16: musespark_avx512::bf16_panels and pack_panel_chunk,
// outer products on weight rows packed once or on the fly (gemm/gemm_kernels.h states the
// contract and the panel layout).
// Compiled for AVX-512F/BW/VL/DQ + BF16 by the pragma below and reached only through the
// dispatch table (common/dispatch.h) on paths whose CPU runs it. No ATen or standard-library
// header after the pragma (common/isa.h: no inline function compiled for AVX-512 may leak into
// the AVX2 world).
#include <cstdint>
#include <immintrin.h>

#include "gemm_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

namespace musespark_avx512 {

namespace {

// A panel is 64 weight rows (4 blocks of 16: one zmm of outputs each) packed so that a
// 64-byte load holds one k pair of 16 rows (the layout of gemm/gemm_kernels.h: a group's 16 pairs of
// block b are 16 consecutive such loads). A tile of 6 x rows broadcasts each x pair and
// multiplies it into the 4 blocks: 24 accumulators, no lane sums at the end, the packed
// panel read from L1/L2 and reused by every tile of x. Calls of up to kLinearMaxRows rows
// read each group block by block, one linear stream; larger ones pair by pair, fetching each
// of the 4 block streams kPanelAhead pairs ahead into L1 (T0; the NTA prefetch dropped at
// 41b532e cost decode 5-15 % on Zen 4).
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
      const int64_t pairs = left >= 32 ? 16 : (left + 1) / 2;  // this group's (the panel layout)
      uint32_t* block = pk + k / 32 * kGroupWords + 16 * pairs * blk;
      for (int64_t p = 0; p < pairs; ++p) _mm512_store_si512(block + 16 * p, r[p]);
    }
}

// Calls of at most this many x rows read each group of the panel as one linear stream
// (panel_tile's `linear`): from memory, the 4 blocks' 1 KiB streams of every 4 KiB group are
// too short for the prefetchers. Measured on Zen 4, one core, 8192 x 8192 packed: 1 row 8.8 ->
// 28.7 GB/s, 8 rows 7.1 -> 16.7, 32 rows 63 -> 89 G multiply-adds/s; 256 rows from L2 are 23 %
// slower that way (the x pairs are broadcast once per block instead of once).
constexpr int64_t kLinearMaxRows = 64;

// MR x rows against a packed chunk of kc k: acc[m][b] (16 outputs of block b) continues from
// y (first chunk: from +0) over the pairs in order, stored back to y (exact: fp32 both).
// `linear`: block by block through each group instead of pair by pair (the same sums in the
// same order: each acc[m][b] still takes the pairs in turn).
template <int MR, bool linear>
inline void panel_tile(const uint16_t* x, int64_t K, int64_t k0, int64_t kc, const uint32_t* pk, float* y,
                       int64_t ldy, const __mmask16* cols, bool first) {
  __m512 acc[MR][kBlocks];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < kBlocks; ++b)
      acc[m][b] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(cols[b], y + m * ldy + 16 * b);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x + k0);  // x pairs (K even)
  const int64_t K2 = K / 2, pairs = (kc + 1) / 2;
  // The groups of the panel layout (gemm/gemm_kernels.h): whole ones (blocks kGroupWords / 4 apart),
  // then a shorter last one (gp pairs: blocks 16 gp apart).
  for (int64_t g0 = 0; g0 < pairs; g0 += kGroupPairs) {
    const bool whole = g0 + kGroupPairs <= pairs;
    const int64_t gp = whole ? kGroupPairs : pairs - g0, block = whole ? kGroupWords / kBlocks : 16 * gp;
    const uint32_t* row = pk + g0 * kPanelRows;
    const int32_t* xq = xp + g0;
    if constexpr (linear) {
      for (int b = 0; b < kBlocks; ++b)
        for (int64_t r = 0; r < gp; ++r) {
          const __m512bh wv = (__m512bh)_mm512_load_si512(row + b * block + 16 * r);
          for (int m = 0; m < MR; ++m)
            acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv, (__m512bh)_mm512_set1_epi32(xq[m * K2 + r]));
        }
      continue;
    }
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

template <bool linear>
inline void tile_of_height(int64_t h, const uint16_t* x, int64_t K, int64_t k0, int64_t kc, const uint32_t* pk,
                           float* y, int64_t ldy, const __mmask16* cols, bool first) {
  switch (h) {
    case 6: panel_tile<6, linear>(x, K, k0, kc, pk, y, ldy, cols, first); break;
    case 5: panel_tile<5, linear>(x, K, k0, kc, pk, y, ldy, cols, first); break;
    case 4: panel_tile<4, linear>(x, K, k0, kc, pk, y, ldy, cols, first); break;
    case 3: panel_tile<3, linear>(x, K, k0, kc, pk, y, ldy, cols, first); break;
    case 2: panel_tile<2, linear>(x, K, k0, kc, pk, y, ldy, cols, first); break;
    default: panel_tile<1, linear>(x, K, k0, kc, pk, y, ldy, cols, first); break;
  }
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
        if (M <= kLinearMaxRows)
          tile_of_height<true>(h, xt, K, k0, kc, panel, yt, ldy, cols, first);
        else
          tile_of_height<false>(h, xt, K, k0, kc, panel, yt, ldy, cols, first);
        m += h;
      }
    }
  }
}

}  // namespace musespark_avx512
