// The one map from (operation, kernel path) to the implementation that runs it.
//
// Each kernel path is one row of a table (common/dispatch.cpp): for every operation with ISA
// variants, the function that path runs. Callers read the row of the path in use
// (`kernels()`) instead of testing the ISA themselves. A null entry means the path has no
// such kernel and the AVX2 code beside the caller runs instead (gemm/avx2_tiles.h,
// attention/decode_avx2.h), or the operation is unavailable (prompt attention on avx2).
//
// The rows: avx2 (nothing but the AVX2 code); avx512 (AVX-512F without bf16 hardware: bf16
// weights widened to fp32 on 16 lanes and the AVX-512 NVFP4 decode); avx512_bf16 (vdpbf16ps products, the AVX-512
// NVFP4 decode, AVX-512 attention); amx_bf16 (avx512_bf16 with the panel product and prompt
// attention on AMX tiles); amx_emulated (amx_bf16 with the tile instructions modelled in
// software, for tests). Two rows that run different kernels for an operation give other bits,
// so a process runs one row for every call (a row's choice never depends on the batch).
//
// Plain C++ (see common/isa.h: included by both worlds).
#pragma once
#include <cstdint>

namespace musespark_dispatch {

enum Path : int { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmxEmulated = 3, kAmxBf16 = 4, kPaths = 5 };

// gemm/gemm_kernels.h states the contracts.
using Bf16Dots = void (*)(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                          float* y, int64_t ldy);
using Widened = void (*)(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                         int64_t ldy);
using Bf16Panels = void (*)(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                            float* y, int64_t ldy, uint32_t* pk, const uint32_t* packed);
// nvfp4/nvfp4.h states the contract.
using Nvfp4Rows = void (*)(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                           const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0, int64_t n1,
                           float* y);
using Nvfp4RowsBf16 = void (*)(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                               const float* const* tables, int64_t rows_per_global, int64_t ldy, int64_t n0,
                               int64_t n1, float* y);
// attention/attention_kernels.h states the contracts.
using DecodeFits = bool (*)(int64_t D, int64_t H);
using DecodeAttention = void (*)(const uint16_t* q, int64_t nh, int64_t G, int64_t D, const uint16_t* k,
                                 const uint16_t* v, int64_t stride, const int64_t* slots, int64_t L, float scale,
                                 float* scores, float* out);
using PrefillFits = bool (*)(int64_t D);
using PrefillRows = void (*)(const uint16_t* q, int64_t nH, int64_t D, int64_t head, const uint16_t* kp,
                             const uint16_t* vp, int64_t m, int64_t q0, int64_t k0, int64_t window, float scale,
                             int64_t t0, int64_t t1, uint16_t* out);
using TileState = void (*)();

struct Kernels {
  const char* name;  // the path's name: "avx2", "avx512", "avx512_bf16", "amx_emulated", "amx_bf16"
  // gemm: products whose x and w both hold bf16 values (null: the AVX2 fp32 tiles take them).
  // bf16_dots for decode rows, bf16_panels for prompt rows and packed weights (gemm/jobs.h
  // split_prompt_runs); two fixed summation orders, each batch invariant.
  Bf16Dots bf16_dots;
  Bf16Panels bf16_panels;
  // bf16_panels keeps superblocks of rows in L2 across the panels of a call (run_jobs then
  // takes several panels at a time: gemm/jobs.cpp steal_chunk).
  bool panel_superblocks;
  // bf16 weights times x without bf16 hardware, widened to fp32 (null: the AVX2 fp32 tiles).
  Widened widened;
  // NVFP4 weight rows, and the x order and magnitude tables they read (nvfp4/nvfp4_tables.h:
  // `pairs` the AVX-512 order, 16 signed magnitudes per scale byte; else 8 magnitudes).
  Nvfp4Rows nvfp4_rows;
  bool nvfp4_pairs;
  // NVFP4 rows times x holding bf16 values on bf16 hardware, x as bf16 bits (natural order)
  // (null: nvfp4_rows takes them too).
  Nvfp4RowsBf16 nvfp4_rows_bf16;
  // Decode attention over a bf16 cache with bf16 queries where decode_fits(D, H) (null: the
  // AVX2 kernel takes every sequence).
  DecodeFits decode_fits;
  DecodeAttention decode_attention;
  // Prompt attention (null: unavailable, the caller keeps SDPA); prefill_tiles instead where
  // prefill_tiles_fit(D) (null: none).
  PrefillRows prefill_rows;
  PrefillFits prefill_tiles_fit;
  PrefillRows prefill_rows_tiles;
  // The calling thread's AMX tile configuration, nested scopes (null: the path keeps no tile
  // state). The tile kernels open their own scope; a caller's scope saves the reloads.
  TileState tiles_begin;
  TileState tiles_end;
};

// The row of the path in use (avx2 until set_path says otherwise).
const Kernels& kernels();
Path path();
// Uses `p` from now on; the caller checked that the CPU runs it (musespark_isa::cpu_runs).
void set_path(Path p);
// The path named `name`, or kPaths when none is.
Path path_named(const char* name);

// Whether bf16 products run on bf16 hardware (vdpbf16ps or AMX) on the path in use.
inline bool bf16_products() { return kernels().bf16_dots != nullptr; }

}  // namespace musespark_dispatch
