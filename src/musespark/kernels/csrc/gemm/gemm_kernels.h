// The bf16 product kernels of the avx512_bf16 and amx paths (common/dispatch.h maps the paths
// to them; gemm/jobs.h says which rows take which), and the packed panel layout they read.
// Plain C++ (common/isa.h: included by both worlds).
#pragma once
#include <cstdint>

#include "../common/thresholds.h"

namespace musespark_avx512 {

// y[m * ldy + n] = sum_k x[m, k] * w[n, k] for m in [0, M), n in [n0, n1); x [M, K] and
// w [N, K] hold bf16 bits, row-major; fp32 accumulation with vdpbf16ps (each bf16 product
// is exact in fp32; pairs are summed into 16 lanes over K in order, the lanes summed at the
// end). Every (m, n) is computed the same way whatever M, n0, n1: batch invariant. K % 8 == 0.
// (gemm/bf16_dots_avx512.cpp)
void bf16_dots(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
               int64_t ldy);

// y[m * ldy + n] = sum_k x[m, k] * w[n, k] for m in [0, M), n in [n0, n1) on the avx512 path
// (AVX-512F, no bf16 hardware): x fp32 [M, K] permuted to the pairs order (nvfp4/nvfp4_tables.h
// permute_x), w bf16 bits [N, K] widened to fp32 in registers, fp32 FMAs, one 16-lane chain per
// (m, n) over K in order, then the fixed lane sum: batch invariant. K % 16 == 0.
// (gemm/widened_avx512.cpp)
void widened_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                  int64_t ldy);

// The same product for prompt rows (gemm/jobs.h: which rows take it): panels of kPanelRows
// weight rows are packed on the fly into `pk` (kPanelWords uint32 of the calling thread's
// scratch, 64-byte aligned), kPanelK k at a time, and multiplied by broadcast x pairs.
// Each (m, n) is one fp32 lane summing the k pairs in order from +0, vdpbf16ps per pair
// (each bf16 product exact): the same whatever M, n0, n1. A different order from
// bf16_dots, so a row must always take the same one of the two. K % 8 == 0.
// (gemm/bf16_panels_avx512.cpp)
//
// Panel layout (packed once, gemm/jobs.h panels_arg, or on the fly): a panel holds 64 weight
// rows (columns of y) over K/2 k pairs, one uint32 per (pair q, column c): the bf16 bits of
// (w[c, 2q], w[c, 2q + 1]), low half first. The pairs come in groups of 16 (the last may be
// shorter: gp pairs); group g starts at word 1024 g and holds 4 blocks of 16 columns, block b
// at 16 gp b; in a block, pair r's 16 columns at 16 r (kernels/cpu.py panel_word). So a
// group is one 4 KiB stretch and each block in it a 1 KiB AMX tile (16 pairs x 64 bytes),
// loaded as one run of memory.
constexpr int64_t kPanelRows = 64;
constexpr int64_t kPanelK = 1024;
constexpr int64_t kPanelWords = kPanelK / 2 * kPanelRows;
constexpr int64_t kGroupPairs = 16;                        // k pairs per group
constexpr int64_t kGroupWords = kGroupPairs * kPanelRows;  // 1024 words: 4 KiB
void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed = nullptr);
// Packs rows [0, np) of w (np <= 64, row stride K) over k in [k0, k0 + kc) into pk as
// bf16_panels does (the panel layout above; rows past np, k past K zero).
void pack_panel_chunk(const uint16_t* w, int64_t K, int64_t np, int64_t k0, int64_t kc, uint32_t* pk);

}  // namespace musespark_avx512

namespace musespark_amx {

// Whether this process may use the AMX tile registers (asks Linux once). (common/amx_state.cpp)
bool request_permission();

// The calling thread's tile configuration, loaded by the outermost of nested begin/end pairs
// and released by its end (LDTILECFG and TILERELEASE once per stretch of products, not per
// call). The hardware tile kernels open their own scope, so a caller's scope only saves the
// reloads. (common/amx_state.cpp)
void tiles_begin();
void tiles_end();

// musespark_avx512::bf16_panels by AMX tiles (gemm/bf16_panels_amx.cpp states the summation
// order): the same arguments and layouts, other bits; `_emulated` with the software model of
// the tile instructions (common/amx_tiles.h), the same bits as the hardware's on inputs
// without denormals. With packed panels, rows are taken kSuperRows at a time against every
// panel of the call.
using musespark_rows::kSuperRows;  // common/thresholds.h
void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed);
void bf16_panels_emulated(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                          float* y, int64_t ldy, uint32_t* pk, const uint32_t* packed);

}  // namespace musespark_amx
