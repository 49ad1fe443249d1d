// Decode attention on AVX-512-BF16 (one query per sequence, bf16 paged cache):
// musespark_avx512::decode_attention (attention/attention_kernels.h;
// attention/decode_attention.cpp states the contract).
// Compiled for AVX-512F/BW/VL/DQ + BF16 by the pragma below and reached only through the
// dispatch table (common/dispatch.h) on paths whose CPU runs it. No ATen or standard-library
// header after the pragma (common/isa.h: no inline function compiled for AVX-512 may leak into
// the AVX2 world).
#include <cstdint>
#include <immintrin.h>

#include "attention_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

#include "../common/simd512.h"

using musespark_simd512::exp16;
using musespark_simd512::load_bh;

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
