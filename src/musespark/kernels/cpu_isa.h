// Run-time ISA dispatch of the native kernels. The AVX2+FMA code is the baseline every
// supported CPU runs; cpu_avx512.cpp holds AVX-512 (F/BW/VL/DQ + BF16) versions of the hot
// loops, compiled for that ISA by a `#pragma GCC target` and called only when `level()`
// says so. The Python side sets the level once at load (`set_isa`, from
// cpu_features.isa(): CPUID lowered by MUSESPARK_ISA); `set_isa` refuses a level the CPU
// lacks, so no path here can raise SIGILL.
//
// This header is included by both worlds, so it declares plain-C++ signatures only (no
// ATen: an inline ATen function instantiated in the AVX-512 file could be picked by the
// linker for the AVX2 world).
#pragma once
#include <cstdint>

namespace musespark_isa {

// kAmxBf16: the AVX-512-BF16 kernels, with AMX tiles for the panel product (cpu_amx.cpp).
enum Level : int { kAvx2 = 1, kAvx512Bf16 = 3, kAmxBf16 = 4 };

// The level the kernels use now (kAvx2 until set_level says otherwise).
int level();
// Returns false (and changes nothing) when the CPU cannot run `want` (for kAmxBf16: CPUID,
// the OS's tile state and its permission, musespark_amx::request_permission). `emulated`
// (kAmxBf16 only, for tests on CPUs with AVX-512-BF16): the AMX schedule with a software
// model of the tile instructions in place of the hardware.
bool set_level(int want, bool emulated = false);
inline bool avx512_bf16() { return level() >= kAvx512Bf16; }
inline bool amx() { return level() >= kAmxBf16; }
bool amx_emulated();

// Batch invariance (default on): every product computes each row the same way whatever
// the batch. Off, prompt-sized bf16 products on AVX-512-BF16/AMX CPUs use oneDNN's GEMM
// (faster, but a row's sums then depend on how many rows share the product).
bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace musespark_isa

namespace musespark_avx512 {

// y[m * ldy + n] = sum_k x[m, k] * w[n, k] for m in [0, M), n in [n0, n1); x [M, K] and
// w [N, K] hold bf16 bits, row-major; fp32 accumulation with vdpbf16ps (each bf16 product
// is exact in fp32; pairs are summed into 16 lanes over K in order, the lanes summed at the
// end). Every (m, n) is computed the same way whatever M, n0, n1: batch invariant. K % 8 == 0.
void bf16_dots(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
               int64_t ldy);

// The same product for prompt rows (cpu_gemv.h: which rows take it): panels of kPanelRows
// weight rows are packed on the fly into `pk` (kPanelWords uint32 of the calling thread's
// scratch, 64-byte aligned), kPanelK k at a time, and multiplied by broadcast x pairs.
// Each (m, n) is one fp32 lane summing the k pairs in order from +0, vdpbf16ps per pair
// (each bf16 product exact): the same whatever M, n0, n1. A different order from
// bf16_dots, so a row must always take the same one of the two. K % 8 == 0.
//
// Panel layout (packed once, cpu_gemv.h panels_arg, or on the fly): a panel holds 64 weight
// rows (columns of y) over K/2 k pairs, one uint32 per (pair q, column c): the bf16 bits of
// (w[c, 2q], w[c, 2q + 1]), low half first. The pairs come in groups of 16 (the last may be
// shorter: gp pairs); group g starts at word 1024 g and holds 4 blocks of 16 columns, block b
// at 16 gp b; in a block, pair r's 16 columns at 16 r (kernels/cpu.py panel_word). So a
// group is one 4 KiB stretch and each block in it a 1 KiB AMX tile (16 pairs x 64 bytes),
// loaded as one run of memory.
constexpr int64_t kPanelRows = 64;
constexpr int64_t kPanelK = 1024;
constexpr int64_t kPanelWords = kPanelK / 2 * kPanelRows;
constexpr int64_t kGroupPairs = 16;                         // k pairs per group
constexpr int64_t kGroupWords = kGroupPairs * kPanelRows;   // 1024 words: 4 KiB
void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed = nullptr);
// Packs rows [0, np) of w (np <= 64, row stride K) over k in [k0, k0 + kc) into pk as
// bf16_panels does (the panel layout of cpu_gemv.h panels_arg; rows past np, k past K zero).
void pack_panel_chunk(const uint16_t* w, int64_t K, int64_t np, int64_t k0, int64_t kc, uint32_t* pk);

// NVFP4 weight-only rows (cpu_nvfp4.cpp states the contract): y[m * ldy + n] for n in [n0, n1)
// from x permuted to the decode order (per 16-block: 8 even then 8 odd elements), codes
// [N, K/2], scale bytes [N, K/16], and per global scale g a table tables[g] of 256 x 16
// signed magnitudes (tables[g][byte * 16 + code]).
void nvfp4_rows(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1, float* y);

// Causal (optionally sliding-window) attention of one query head over packed keys and
// values (cpu_prefill_attention.cpp packs them and states the contract): rows t in
// [t0, t1) of q [n, nH, D] (positions q0 + t) against m keys (positions k0 + i), bf16
// out [n, nH, D]. Scores and the online softmax in fp32; P rounded to bf16 for P V.
void prefill_attention_rows(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                            const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                            int64_t t0, int64_t t1, uint16_t* out);

}  // namespace musespark_avx512

namespace musespark_avx512 {

// Decode attention over a bf16 paged cache for one sequence's nh adjacent KV heads and
// their G query heads each (cpu_attention.cpp states the contract), when
// decode_attention_fits(D, H) for the sequence's H query heads. q [nh * G, D] bf16 bits;
// k, v point at the first KV head's first element, key i's rows at slots[i] * stride
// (+ h * D for head h); scores: [nh * G, L] scratch. Scores scale * q . k_i by vdpbf16ps (exact products, fp32 sums in one fixed
// order), softmax in fp32 (16-lane exp, sums and max), out [nh * G, D] fp32 =
// (sum_i p[g, i] * v_i, FMAs in key order) / sum_i p[g, i]. Each head's result is the same
// whatever nh.
bool decode_attention_fits(int64_t D, int64_t H);
void decode_attention(const uint16_t* q, int64_t nh, int64_t G, int64_t D, const uint16_t* k, const uint16_t* v,
                      int64_t stride, const int64_t* slots, int64_t L, float scale, float* scores, float* out);

}  // namespace musespark_avx512

namespace musespark_amx {

// Whether this process may use the AMX tile registers (asks Linux once).
bool request_permission();

// The calling thread's tile configuration, loaded by the outermost of nested begin/end pairs
// and released by its end (LDTILECFG and TILERELEASE once per stretch of products, not per
// call). bf16_panels opens its own scope, so a caller's scope only saves the reloads.
void tiles_begin();
void tiles_end();

// musespark_avx512::bf16_panels by AMX tiles (cpu_amx.cpp states the summation order): the
// same arguments and layouts, other bits. Runs where level() is kAmxBf16 (cpu_gemv.h).
// With packed panels, rows are taken kSuperRows at a time against every panel of the call.
constexpr int64_t kSuperRows = 256;
void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed = nullptr);

// musespark_avx512::prefill_attention_rows on AMX tiles (cpu_amx_attention.cpp states the
// summation order): the same arguments and packed layouts, with the keys packed to a multiple
// of 32 (zeros past m); other bits. Runs where level() is kAmxBf16 and
// prefill_attention_fits(D) (cpu_prefill_attention.cpp).
bool prefill_attention_fits(int64_t D);
void prefill_attention_rows(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                            const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                            int64_t t0, int64_t t1, uint16_t* out);

}  // namespace musespark_amx
