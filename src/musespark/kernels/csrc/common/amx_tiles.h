// AMX-BF16 tile primitives shared by the tile kernels (gemm/bf16_panels_amx.cpp: the panel
// product; attention/prefill_amx.cpp: prompt attention; common/amx_state.cpp: the tile state).
// Included only by files compiled for AVX-512 (their `#pragma GCC target`), after the pragma;
// the headers it needs (below) come before the pragma, so none of them is compiled for
// AVX-512. Everything here has internal linkage.
//
// `Hardware` issues the tile instructions; `Emulated` models them in software (TDPBF16PS as
// the Intel SDM states it per element), so the tests run every tile schedule on CPUs without
// AMX (`set_isa("amx_emulated")`): it checks layouts, padding and grouping; only a CPU with
// AMX checks the hardware's own rounding. Both offer the same static functions.
#pragma once
// Needs, included before the pragma: <cmath> <cstdint> <cstdlib> <cstring> <immintrin.h>
// "gemm/gemm_kernels.h".

namespace musespark_amx {
namespace {

constexpr int64_t kRows = 16;          // rows of every tile
constexpr int64_t kStepK = 32;         // k per TDPBF16PS (16 pairs)
constexpr int64_t kPanel = musespark_avx512::kPanelRows;  // 64 weight rows: C0-C3
// A full group of a panel (gemm/gemm_kernels.h layout): B tile b at words 256 b, its 16 pairs 64
// bytes apart.
constexpr int64_t kBlockWords = musespark_avx512::kGroupWords / 4;
constexpr int64_t kBlockRowBytes = 64;

// The tile instructions by inline assembly (the tile numbers are part of the instruction),
// each with a memory clobber: a tile load must see the stores before it, and the compiler
// must not move later reads of y above a tile store.
#define MS_TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define MS_TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define MS_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
// AT&T order: B, A, C (Intel: tdpbf16ps tmmC, tmmA, tmmB).
#define MS_TILE_DP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct Hardware {
  static void configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kRows;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  }
  static void release() { __asm__ volatile("tilerelease" ::: "memory"); }
  static void zero_c() {
    MS_TILE_ZERO(0);
    MS_TILE_ZERO(1);
    MS_TILE_ZERO(2);
    MS_TILE_ZERO(3);
  }
  // C_b from / to c + 16 b (fp32, row stride `stride` bytes).
  static void load_c(const float* c, int64_t stride) {
    MS_TILE_LOAD(0, c, stride);
    MS_TILE_LOAD(1, c + 16, stride);
    MS_TILE_LOAD(2, c + 32, stride);
    MS_TILE_LOAD(3, c + 48, stride);
  }
  static void store_c(float* c, int64_t stride) {
    MS_TILE_STORE(0, c, stride);
    MS_TILE_STORE(1, c + 16, stride);
    MS_TILE_STORE(2, c + 32, stride);
    MS_TILE_STORE(3, c + 48, stride);
  }
  // The 2 x 2 arrangement's C from / to c (C0 at c, C1 at c + 16, C2, C3 16 rows below).
  static void load_c2(const float* c, int64_t stride) {
    MS_TILE_LOAD(0, c, stride);
    MS_TILE_LOAD(1, c + 16, stride);
    MS_TILE_LOAD(2, c + 4 * stride, stride);
    MS_TILE_LOAD(3, c + 4 * stride + 16, stride);
  }
  static void store_c2(float* c, int64_t stride) {
    MS_TILE_STORE(0, c, stride);
    MS_TILE_STORE(1, c + 16, stride);
    MS_TILE_STORE(2, c + 4 * stride, stride);
    MS_TILE_STORE(3, c + 4 * stride + 16, stride);
  }
  // One full group of 16 k pairs, 2 x 2: A0, A1 from a0, a1 (a_stride bytes between rows),
  // B0, B1 the blocks at b and b + kBlockWords.
  static void step2(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, const uint32_t* b) {
    MS_TILE_LOAD(4, a0, a_stride);
    MS_TILE_LOAD(6, b, kBlockRowBytes);
    MS_TILE_DP(0, 4, 6);
    MS_TILE_LOAD(7, b + kBlockWords, kBlockRowBytes);
    MS_TILE_DP(1, 4, 7);
    MS_TILE_LOAD(5, a1, a_stride);
    MS_TILE_DP(2, 5, 6);
    MS_TILE_DP(3, 5, 7);
  }
  // Prompt attention (attention/prefill_amx.cpp), tmm0-1 scores, tmm2 the queries or weights,
  // tmm4-5 keys or values:
  // s [16, 32] fp32 (rows 128 bytes apart) = q [16, D] (rows q_stride bytes apart) against
  // two blocks of 16 packed keys (kb and kb + pairs * 32: per dimension pair, 16 keys' pairs),
  // 32 dimensions per TDPBF16PS from d = 0.
  static void scores(const uint16_t* q, int64_t q_stride, int64_t D, const uint16_t* kb, int64_t pairs, float* s) {
    MS_TILE_ZERO(0);
    MS_TILE_ZERO(1);
    for (int64_t c = 0; c < D / 32; ++c) {
      MS_TILE_LOAD(2, q + 32 * c, q_stride);
      MS_TILE_LOAD(4, kb + 16 * c * 32, 64);
      MS_TILE_DP(0, 2, 4);
      MS_TILE_LOAD(5, kb + (pairs + 16 * c) * 32, 64);
      MS_TILE_DP(1, 2, 5);
    }
    MS_TILE_STORE(0, s, 128);
    MS_TILE_STORE(1, s + 16, 128);
  }
  // o [16, D] fp32 (rows D floats apart) += p [16, 32] bf16 (rows 64 bytes apart) times 32
  // keys' values vb (per key pair and 16 dimensions: 16 pairs; key pairs chunks * 64 bytes
  // apart), one TDPBF16PS per 16 dimensions. D = 16 chunks, chunks even.
  static void values(const uint16_t* p, const uint16_t* vb, int64_t chunks, float* o) {
    const int64_t D = 16 * chunks;
    MS_TILE_LOAD(2, p, 64);
    for (int64_t c = 0; c < chunks; c += 2) {
      MS_TILE_LOAD(0, o + 16 * c, D * 4);
      MS_TILE_LOAD(4, vb + c * 32, chunks * 64);
      MS_TILE_DP(0, 2, 4);
      MS_TILE_LOAD(1, o + 16 * c + 16, D * 4);
      MS_TILE_LOAD(5, vb + c * 32 + 32, chunks * 64);
      MS_TILE_DP(1, 2, 5);
      MS_TILE_STORE(0, o + 16 * c, D * 4);
      MS_TILE_STORE(1, o + 16 * c + 16, D * 4);
    }
  }
  // One full group of 16 k pairs at b, 1 x 4: A from a (16 rows, a_stride bytes apart), B_b
  // the group's block b. B tiles rotate through tmm5-7.
  static void step(const uint16_t* a, int64_t a_stride, const uint32_t* b) {
    MS_TILE_LOAD(4, a, a_stride);
    MS_TILE_LOAD(5, b, kBlockRowBytes);
    MS_TILE_DP(0, 4, 5);
    MS_TILE_LOAD(6, b + kBlockWords, kBlockRowBytes);
    MS_TILE_DP(1, 4, 6);
    MS_TILE_LOAD(7, b + 2 * kBlockWords, kBlockRowBytes);
    MS_TILE_DP(2, 4, 7);
    MS_TILE_LOAD(5, b + 3 * kBlockWords, kBlockRowBytes);
    MS_TILE_DP(3, 4, 5);
  }
};

#undef MS_TILE_LOAD
#undef MS_TILE_STORE
#undef MS_TILE_ZERO
#undef MS_TILE_DP

// The software model: the calling thread's C tiles, TDPBF16PS as the Intel SDM states it per
// element (two fp32 partial sums, even and odd halves of the pairs, each from +0 over the
// instruction's 16 pairs by fused multiply-adds, then added to C: (C + even) + odd; inputs
// and outputs denormals kept, which the hardware flushes: the tests use no denormals).
struct Emulated {
  struct State {
    float c[4][kRows][16];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void zero_c() { std::memset(&state(), 0, sizeof(State)); }
  // C tile t from / to c + r * stride bytes + col floats.
  static void load_tile(int t, const float* c, int64_t stride) {
    for (int m = 0; m < kRows; ++m) std::memcpy(state().c[t][m], reinterpret_cast<const char*>(c) + m * stride, 64);
  }
  static void store_tile(int t, float* c, int64_t stride) {
    for (int m = 0; m < kRows; ++m) std::memcpy(reinterpret_cast<char*>(c) + m * stride, state().c[t][m], 64);
  }
  static void load_c(const float* c, int64_t stride) {
    for (int b = 0; b < 4; ++b) load_tile(b, c + 16 * b, stride);
  }
  static void store_c(float* c, int64_t stride) {
    for (int b = 0; b < 4; ++b) store_tile(b, c + 16 * b, stride);
  }
  static void load_c2(const float* c, int64_t stride) {
    for (int t = 0; t < 4; ++t) load_tile(t, c + (t / 2) * 4 * stride + 16 * (t % 2), stride);
  }
  static void store_c2(float* c, int64_t stride) {
    for (int t = 0; t < 4; ++t) store_tile(t, c + (t / 2) * 4 * stride + 16 * (t % 2), stride);
  }
  static float widen(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // TDPBF16PS into C tile t: A from a (rows a_stride bytes apart), B from b (pair words, rows
  // b_stride words apart).
  static void dp(int t, const uint16_t* a, int64_t a_stride, const uint32_t* b, int64_t b_stride) {
    for (int m = 0; m < kRows; ++m) {
      const auto* row = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(a) + m * a_stride);
      for (int n = 0; n < 16; ++n) {
        float even = 0.0f, odd = 0.0f;
        for (int k = 0; k < 16; ++k) {
          const uint32_t pair = b[k * b_stride + n];
          even = std::fma(widen(row[2 * k]), widen(static_cast<uint16_t>(pair)), even);
          odd = std::fma(widen(row[2 * k + 1]), widen(static_cast<uint16_t>(pair >> 16)), odd);
        }
        float& c = state().c[t][m][n];
        c = (c + even) + odd;
      }
    }
  }
  static void step(const uint16_t* a, int64_t a_stride, const uint32_t* b) {
    for (int blk = 0; blk < 4; ++blk) dp(blk, a, a_stride, b + blk * kBlockWords, 16);
  }
  static void scores(const uint16_t* q, int64_t q_stride, int64_t D, const uint16_t* kb, int64_t pairs, float* s) {
    zero_c();
    const auto* k = reinterpret_cast<const uint32_t*>(kb);
    for (int64_t c = 0; c < D / 32; ++c) {
      dp(0, q + 32 * c, q_stride, k + 16 * c * 16, 16);
      dp(1, q + 32 * c, q_stride, k + (pairs + 16 * c) * 16, 16);
    }
    store_tile(0, s, 128);
    store_tile(1, s + 16, 128);
  }
  static void values(const uint16_t* p, const uint16_t* vb, int64_t chunks, float* o) {
    const int64_t D = 16 * chunks;
    const auto* v = reinterpret_cast<const uint32_t*>(vb);
    for (int64_t c = 0; c < chunks; ++c) {
      load_tile(0, o + 16 * c, D * 4);
      dp(0, p, 64, v + c * 16, chunks * 16);
      store_tile(0, o + 16 * c, D * 4);
    }
  }
  static void step2(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, const uint32_t* b) {
    dp(0, a0, a_stride, b, 16);
    dp(1, a0, a_stride, b + kBlockWords, 16);
    dp(2, a1, a_stride, b, 16);
    dp(3, a1, a_stride, b + kBlockWords, 16);
  }
};

// Per-thread scratch, 64-byte aligned, grown as needed (never shrunk); zeros when new.
template <typename T>
T* scratch(int slot, int64_t count) {
  struct Buf {
    void* p = nullptr;
    int64_t bytes = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf bufs[8];
  Buf& b = bufs[slot];
  const int64_t want = (count * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
  if (b.bytes < want) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, want);
    std::memset(b.p, 0, want);
    b.bytes = want;
  }
  return static_cast<T*>(b.p);
}

}  // namespace
}  // namespace musespark_amx
