// The attention kernels of the avx512_bf16 and amx paths (common/dispatch.h maps the paths to
// them). Plain C++ (common/isa.h: included by both worlds).
#pragma once
#include <cstdint>

namespace musespark_avx512 {

// Causal (optionally sliding-window) attention of one query head over packed keys and
// values (attention/prefill_attention.cpp packs them and states the contract): rows t in
// [t0, t1) of q [n, nH, D] (positions q0 + t) against m keys (positions k0 + i), bf16
// out [n, nH, D]. Scores and the online softmax in fp32; P rounded to bf16 for P V.
// (attention/prefill_avx512.cpp)
void prefill_attention_rows(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                            const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                            int64_t t0, int64_t t1, uint16_t* out);

// Decode attention over a bf16 paged cache for one sequence's nh adjacent KV heads and
// their G query heads each (attention/decode_attention.cpp states the contract), when
// decode_attention_fits(D, H) for the sequence's H query heads. q [nh * G, D] bf16 bits;
// k, v point at the first KV head's first element, key i's rows at slots[i] * stride
// (+ h * D for head h); scores: [nh * G, L] scratch. Scores scale * q . k_i by vdpbf16ps
// (exact products, fp32 sums in one fixed order), softmax in fp32 (16-lane exp, sums and
// max), out [nh * G, D] fp32 = (sum_i p[g, i] * v_i, FMAs in key order) / sum_i p[g, i].
// Each head's result is the same whatever nh. (attention/decode_avx512.cpp)
bool decode_attention_fits(int64_t D, int64_t H);
void decode_attention(const uint16_t* q, int64_t nh, int64_t G, int64_t D, const uint16_t* k, const uint16_t* v,
                      int64_t stride, const int64_t* slots, int64_t L, float scale, float* scores, float* out);

}  // namespace musespark_avx512

namespace musespark_amx {

// musespark_avx512::prefill_attention_rows on AMX tiles (attention/prefill_amx.cpp states the
// summation order): the same arguments and packed layouts, with the keys packed to a multiple
// of 32 (zeros past m); other bits. For head dims where prefill_attention_fits(D); `_emulated`
// with the software model of the tile instructions.
bool prefill_attention_fits(int64_t D);
void prefill_attention_rows(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                            const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                            int64_t t0, int64_t t1, uint16_t* out);
void prefill_attention_rows_emulated(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                                     const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window,
                                     float scale, int64_t t0, int64_t t1, uint16_t* out);

}  // namespace musespark_amx
