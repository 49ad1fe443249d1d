// Paged decode attention on AVX2 + FMA (attention/decode_avx2.cpp): the kernel every path
// runs for the sequences the dispatch table's decode_attention does not take (common/dispatch.h).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

namespace musespark_attention {

// One KV head, its G query heads (q [G, D] fp32), over the keys at `slots` (L of them; key i's
// rows at k_cache + slots[i] * slot_stride, likewise v_cache; T fp32, at::BFloat16 or
// c10::Float8_e4m3fn, read as stored):
// out [G, D] fp32 = softmax(scale * q . k) @ v. Each key row is widened once and dotted with
// every query head, 8 keys at a time (8 lanes over D in order, then a fixed tree); softmax in
// fp32 (exp by the polynomial of common/simd.h), the normalizer summed in key order; each
// head's output accumulates the value rows in key order. scores: [G, L] scratch.
template <typename T>
void attend_head(const float* q, int64_t G, int64_t D, const T* k_cache, const T* v_cache, int64_t slot_stride,
                 const int64_t* slots, int64_t L, float scale, float* scores, float* out);

extern template void attend_head<float>(const float* q, int64_t G, int64_t D, const float* k_cache,
                                        const float* v_cache, int64_t slot_stride, const int64_t* slots, int64_t L,
                                        float scale, float* scores, float* out);
extern template void attend_head<at::BFloat16>(const float* q, int64_t G, int64_t D, const at::BFloat16* k_cache,
                                               const at::BFloat16* v_cache, int64_t slot_stride,
                                               const int64_t* slots, int64_t L, float scale, float* scores,
                                               float* out);
extern template void attend_head<c10::Float8_e4m3fn>(const float* q, int64_t G, int64_t D,
                                                     const c10::Float8_e4m3fn* k_cache,
                                                     const c10::Float8_e4m3fn* v_cache, int64_t slot_stride,
                                                     const int64_t* slots, int64_t L, float scale, float* scores,
                                                     float* out);

}  // namespace musespark_attention
