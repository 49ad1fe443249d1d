// What the NVFP4 rows (nvfp4/nvfp4.h) read besides the weight: x in the decode order and the
// decoded magnitudes of every block-scale byte (nvfp4/nvfp4_tables.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace musespark_nvfp4 {

constexpr int64_t kBlock = 16;

// x rows [M, K] permuted to the decode order: per block, the 8 even elements then the 8
// odd ones; `pairs` (the AVX-512 order): per two blocks a, b: even a, even b, odd a, odd b
// (a final odd block as before).
std::vector<float> permute_x(const float* p, int64_t M, int64_t K, bool pairs);

// The decoded magnitudes of every scale byte for one global scale g: |E2M1[c]| * e4m3(byte) *
// g, bf16-rounded when `round_bf16` (x is bf16): 8 per byte (table[byte * 8 + c]) for the AVX2
// rows, each stored with bits 28-30 XOR c (the AVX2 decode XORs a code shifted left by 28 onto
// the entry it looks up: that restores the magnitude and sets the code's sign in one
// instruction), or with `pairs` 16 signed ones ([m, -m]) for the AVX-512 rows. A pairs table with
// `round_bf16` holds after its 4096 floats the same 4096 values as bf16 bits (the AVX-512-BF16
// rows' twin: uint16 [byte * 16 + c] from table + 4096). A pure function of
// (g, rounding, layout), so tables are built once per process and kept (a weight's global
// scale never changes; 8, 16 or 24 KiB each, at most kMaxTables of them, after which new ones are
// built per call into `spill`).
constexpr size_t kMaxTables = 8192;
const float* table_for(float g, bool round_bf16, bool pairs, std::vector<float>& spill);

}  // namespace musespark_nvfp4
