// The NVFP4 rows' inputs besides the weight (nvfp4/nvfp4_tables.h): the magnitude tables and x
// in the decode order.
#include "nvfp4_tables.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace musespark_nvfp4 {
namespace {

// The 256 e4m3fn bytes as fp32 (exact): bias 7, subnormals m * 2^-9, 0x7F / 0xFF NaN.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float x = (e == 15 && m == 7) ? std::numeric_limits<float>::quiet_NaN()
                : e == 0             ? std::ldexp(static_cast<float>(m), -9)
                                     : std::ldexp(1.f + m / 8.f, e - 7);
      v[b] = s ? -x : x;
    }
  }
};
inline const E4m3Table& e4m3() {
  static const E4m3Table table;
  return table;
}

// |E2M1| of codes 0..7 (bits 2-1 exponent, bit 0 mantissa); bit 3 is the sign.
inline __m256 e2m1_magnitudes() { return _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f); }

// fp32 -> nearest bf16 (ties to even), kept as an fp32 (NaN stays NaN for quiet NaNs).
inline __m256 round_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The 8 decoded magnitudes |E2M1[c]| * t (bf16-rounded when x is bf16) of every block-scale
// byte, for one global scale: table[byte * 8 + c]. Built once per call (256 multiplies of 8
// lanes), it replaces the per-block multiply and rounding with one 32-byte load from L1.
template <bool kRoundBf16>
inline void magnitude_table(float global, float* table) {
  const __m256 mag_codes = e2m1_magnitudes();
  for (int b = 0; b < 256; ++b) {
    const float t = e4m3().v[b] * global;  // the reference's order: the two scales first
    __m256 mags = _mm256_mul_ps(mag_codes, _mm256_set1_ps(t));
    if (kRoundBf16) mags = round_bf16(mags);  // sign-symmetric: bf16(-v) == -bf16(v)
    _mm256_storeu_ps(table + b * 8, mags);
  }
}

}  // namespace

// x rows [M, K] permuted to the decode order: per block, the 8 even elements then the 8
// odd ones; `pairs` (the AVX-512 order): per two blocks a, b: even a, even b, odd a, odd b
// (a final odd block as before).
std::vector<float> permute_x(const float* p, int64_t M, int64_t K, bool pairs) {
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m) {
    int64_t b = 0;
    if (pairs)
      for (; b + 2 * kBlock <= K; b += 2 * kBlock)
        for (int64_t h = 0; h < 2; ++h)      // block a, block b
          for (int64_t i = 0; i < 8; ++i) {  // elements 2i (even) and 2i+1 (odd) of the block
            out[m * K + b + h * 8 + i] = p[m * K + b + h * kBlock + 2 * i];
            out[m * K + b + 16 + h * 8 + i] = p[m * K + b + h * kBlock + 2 * i + 1];
          }
    for (; b < K; b += kBlock)
      for (int64_t i = 0; i < 8; ++i) {
        out[m * K + b + i] = p[m * K + b + 2 * i];
        out[m * K + b + 8 + i] = p[m * K + b + 2 * i + 1];
      }
  }
  return out;
}

// Built by magnitude_table on first use, then kept (nvfp4/nvfp4_tables.h).
const float* table_for(float g, bool round_bf16, bool pairs, std::vector<float>& spill) {
  static std::mutex lock;
  static std::unordered_map<uint64_t, std::unique_ptr<std::vector<float>>> cache;
  uint32_t bits;
  std::memcpy(&bits, &g, sizeof bits);
  const uint64_t key = (static_cast<uint64_t>(bits) << 2) | (round_bf16 ? 2u : 0u) | (pairs ? 1u : 0u);
  {
    std::lock_guard<std::mutex> hold(lock);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second->data();
  }
  std::vector<float> t8(256 * 8);
  if (round_bf16)
    magnitude_table<true>(g, t8.data());
  else
    magnitude_table<false>(g, t8.data());
  auto table = std::make_unique<std::vector<float>>();
  if (pairs) {
    table->resize(256 * 16 + (round_bf16 ? 256 * 8 : 0));
    for (int64_t i = 0; i < 256; ++i)
      for (int64_t c = 0; c < 8; ++c) {
        (*table)[i * 16 + c] = t8[i * 8 + c];
        (*table)[i * 16 + 8 + c] = -t8[i * 8 + c];
      }
    if (round_bf16) {  // the bf16 twin: the upper halves (exact, every value is a bf16 value)
      auto* twin = reinterpret_cast<uint16_t*>(table->data() + 256 * 16);
      for (int64_t i = 0; i < 256 * 16; ++i) {
        uint32_t u;
        std::memcpy(&u, &(*table)[i], sizeof u);
        twin[i] = static_cast<uint16_t>(u >> 16);
      }
    }
  } else {  // the AVX2 layout: entry c holds its magnitude's bits XOR c << 28 (nvfp4_tables.h)
    for (int64_t i = 0; i < 256; ++i)
      for (uint32_t c = 0; c < 8; ++c) {
        uint32_t u;
        std::memcpy(&u, &t8[i * 8 + c], sizeof u);
        u ^= c << 28;
        std::memcpy(&t8[i * 8 + c], &u, sizeof u);
      }
    *table = std::move(t8);
  }
  std::lock_guard<std::mutex> hold(lock);
  if (cache.size() >= kMaxTables) {
    spill = std::move(*table);
    return spill.data();
  }
  auto& slot = cache[key];
  if (!slot) slot = std::move(table);  // (another thread may have built the same one)
  return slot->data();
}

}  // namespace musespark_nvfp4
