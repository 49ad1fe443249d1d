// Prompt attention on AMX tiles: musespark_avx512::prefill_attention_rows
// (attention/attention_kernels.h, attention/prefill_attention.cpp: the contract and the packed
// layouts) with Q K^T and P V by TDPBF16PS, on the amx_bf16 path for head dims that are
// multiples of 32.
//
// Why: a prompt's attention is compute-bound (a 2048-token prompt spent a third of its time
// there on the Xeon measured: benchmarks/RESULTS.md, at f0fbb0f), and one TDPBF16PS does
// 8192 bf16 products.
//
// Schedule: 16 query rows of one head (consecutive tokens) at a time, against blocks of 32
// keys from a multiple of 32 (key index 0 is the first gathered key). Per block: scores
// s [16, 32] = Q K^T (32 dimensions per TDPBF16PS from d = 0), scaled in fp32; per row, the
// online softmax as the AVX-512 kernel does it (the running max rises once per block, the
// sums of the row are scaled by exp(old - new)); P rounded to bf16; then O += P V on the
// tiles (O [16, D] fp32 in memory, loaded into C, 32 keys per TDPBF16PS, stored back).
//
// Invariant (batch invariance within a sequence): every step of a row reads that row alone
// (a tile's rows never mix), the blocks are fixed by the key index, and a block a row does
// not reach leaves its state as it was (its weights are +0, its max and sums unchanged), so
// a row's result does not depend on which rows share its tile or on the chunk's length.
// The bits differ from the AVX-512 kernel's (other summation order), so a CPU runs one or
// the other (common/dispatch.h).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>

#include "../gemm/gemm_kernels.h"
#include "attention_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

#include "../common/amx_tiles.h"
#include "../common/simd512.h"

namespace musespark_amx {
namespace {

using musespark_simd512::exp16;

constexpr int64_t kKeys = 32;  // keys per block: one TDPBF16PS of P V

template <class Tiles>
void attend(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp, const uint16_t* vp, int64_t m,
            int64_t q0, int64_t k0, int64_t window, float scale, int64_t t0, int64_t t1, uint16_t* out) {
  const int64_t pairs = D / 2, chunks = D / 16;
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  float* s = scratch<float>(4, kRows * kKeys);       // scores of the block
  uint16_t* p = scratch<uint16_t>(5, kRows * kKeys);  // weights of the block, bf16
  float* o = scratch<float>(6, kRows * D);            // the rows' outputs, unnormalized
  uint16_t* qpad = scratch<uint16_t>(7, kRows * D);   // a partial tile's queries, zero-padded
  for (int64_t t = t0; t < t1; t += kRows) {
    const int rows = static_cast<int>(t1 - t < kRows ? t1 - t : kRows);
    const uint16_t* qt = q + (t * nH + head) * D;
    int64_t q_stride = nH * D * 2;
    if (rows < kRows) {
      std::memset(qpad, 0, kRows * D * sizeof(uint16_t));
      for (int r = 0; r < rows; ++r) std::memcpy(qpad + r * D, q + ((t + r) * nH + head) * D, D * 2);
      qt = qpad, q_stride = D * 2;
    }
    // Keys any of these rows reaches: positions (pos - window, pos], as key indices.
    const int64_t first_pos = q0 + t, last_pos = q0 + t + rows - 1;
    int64_t k_lo = window > 0 ? first_pos - window + 1 - k0 : 0;
    if (k_lo < 0) k_lo = 0;
    int64_t k_hi = last_pos - k0 + 1;  // exclusive
    if (k_hi > m) k_hi = m;
    float mx[kRows];
    __m512 sum[kRows];  // lane-wise normalizers
    for (int r = 0; r < kRows; ++r) mx[r] = -__builtin_inff(), sum[r] = _mm512_setzero_ps();
    std::memset(o, 0, kRows * D * sizeof(float));
    for (int64_t b = k_lo / kKeys; b * kKeys < k_hi; ++b) {
      Tiles::scores(qt, q_stride, D, kp + 2 * b * pairs * 32, pairs, s);
      const int64_t lo = k0 + b * kKeys;  // position of the block's first key
      const bool interior = b * kKeys + kKeys <= m && lo + kKeys - 1 <= first_pos && (window == 0 || lo > last_pos - window);
      for (int r = 0; r < kRows; ++r) {
        uint16_t* pr = p + r * kKeys;
        __m512 sc[2];
        __mmask16 ok[2] = {0xFFFF, 0xFFFF};
        for (int n = 0; n < 2; ++n) sc[n] = _mm512_mul_ps(_mm512_loadu_ps(s + r * kKeys + 16 * n), _mm512_set1_ps(scale));
        bool any = r < rows;
        if (any && !interior) {
          const int64_t pos = q0 + t + r;
          __mmask16 reach = 0;
          for (int n = 0; n < 2; ++n) {
            ok[n] = musespark_simd512::reachable16(lo + 16 * n, pos, k0 + m, window);
            sc[n] = _mm512_mask_mov_ps(neg_inf, ok[n], sc[n]);
            reach |= ok[n];
          }
          any = reach != 0;
        }
        if (!any) {  // no key here for this row (or no row): weights +0, state unchanged
          std::memset(pr, 0, kKeys * sizeof(uint16_t));
          continue;
        }
        const __m512 top = _mm512_max_ps(sc[0], sc[1]);
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(mx[r]), _CMP_GT_OQ) != 0) {
          const float nmax = std::fmax(mx[r], _mm512_reduce_max_ps(top));
          const __m512 corr = mx[r] == -__builtin_inff() ? _mm512_setzero_ps() : exp16(_mm512_set1_ps(mx[r] - nmax));
          sum[r] = _mm512_mul_ps(sum[r], corr);
          for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(o + r * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), corr));
          mx[r] = nmax;
        }
        for (int n = 0; n < 2; ++n) {  // P in bf16 for the P V product (as flash attention)
          const __m256bh pb =
              _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(ok[n], exp16(_mm512_sub_ps(sc[n], _mm512_set1_ps(mx[r])))));
          sum[r] = _mm512_add_ps(sum[r], _mm512_cvtpbh_ps(pb));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * n), (__m256i)pb);
        }
      }
      Tiles::values(p, vp + b * (kKeys / 2) * chunks * 32, chunks, o);
    }
    for (int r = 0; r < rows; ++r) {
      const float total = _mm512_reduce_add_ps(sum[r]);
      const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);  // no reachable key: zeros
      uint16_t* dst = out + ((t + r) * nH + head) * D;
      for (int64_t c = 0; c < chunks; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), inv)));
    }
  }
}

}  // namespace

bool prefill_attention_fits(int64_t D) { return D % 32 == 0 && D <= 256; }

void prefill_attention_rows(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                            const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                            int64_t t0, int64_t t1, uint16_t* out) {
  tiles_begin();  // free inside the caller's scope
  attend<Hardware>(q, nH, D, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
  tiles_end();
}

void prefill_attention_rows_emulated(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                                     const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window,
                                     float scale, int64_t t0, int64_t t1, uint16_t* out) {
  attend<Emulated>(q, nH, D, head, kp, vp, m, q0, k0, window, scale, t0, t1, out);
}

}  // namespace musespark_amx
