// Prompt attention on AVX-512-BF16 (vdpbf16ps for Q K^T and P V):
// musespark_avx512::prefill_attention_rows (attention/attention_kernels.h;
// attention/prefill_attention.cpp states the contract and the packed layouts).
// Compiled for AVX-512F/BW/VL/DQ + BF16 by the pragma below and reached only through the
// dispatch table (common/dispatch.h) on paths whose CPU runs it. No ATen or standard-library
// header after the pragma (common/isa.h: no inline function compiled for AVX-512 may leak into
// the AVX2 world).
#include <cstdint>
#include <immintrin.h>
#include <type_traits>

#include "attention_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

#include "../common/simd512.h"

using musespark_simd512::exp16;
using musespark_simd512::reachable16;

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
