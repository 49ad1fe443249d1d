// AMX-BF16 tiles for the panel product (cpu_isa.h declares the entry points; cpu_gemv.h
// bf16_rows says which rows take them): y[m, n] = sum_k x[m, k] w[n, k] on the same packed
// panels the AVX-512 panel kernel reads, by TDPBF16PS instead of vdpbf16ps.
//
// Why: on CPUs with AMX (Sapphire Rapids and later) one TDPBF16PS multiplies a 16 x 32 bf16
// tile of x by a 32 x 16 tile of the weight (8192 products), several times the vdpbf16ps
// rate, and prompt-sized products are compute-bound.
//
// Tiles (one configuration, every tile 16 rows x 64 bytes): C0-C3 the 16 x 64 fp32 outputs
// of a 16-row block of x against one 64-row panel (C_b: panel columns 16b..16b+15), A the
// block's next 32 k (16 rows of 32 bf16), B the panel's next 16 k pairs of 16 columns
// (16 rows of 16 pair words: exactly the panel layout, 256 bytes from one pair to the next).
//
// Invariant (batch invariance): each output element starts from +0 and takes the k pairs in
// one fixed grouping, 16 pairs (32 k) per TDPBF16PS from k = 0, the last group zero-padded;
// between 1024-k chunks it is stored to y and reloaded (fp32, exact). Nothing in that depends
// on M, on which rows share a tile (a tile's rows never mix), on n0/n1 or on the thread, so a
// row gets the same bits in any batch. The bits differ from the vdpbf16ps panel kernel's, so
// a CPU runs one or the other for every row (cpu_isa.h level()).
//
// `Emulated` runs the same schedule with a software model of the four tile instructions: the
// tests run every product through it on CPUs without AMX (it checks the layout, padding and
// grouping; only a CPU with AMX checks the hardware's own rounding).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_isa.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

namespace musespark_amx {
namespace {

constexpr int64_t kRows = 16;          // rows of every tile
constexpr int64_t kStepK = 32;         // k per TDPBF16PS (16 pairs)
constexpr int64_t kPanel = musespark_avx512::kPanelRows;  // 64 weight rows: C0-C3
constexpr int64_t kPairBytes = kPanel * 4;                // one k pair of a panel: 256 bytes

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
  // One group of 16 k pairs: A from a (16 rows, a_stride bytes apart), B_b from b + 16 b
  // (pair words, 16 rows 256 bytes apart). B tiles rotate through tmm5-7.
  static void step(const uint16_t* a, int64_t a_stride, const uint32_t* b) {
    MS_TILE_LOAD(4, a, a_stride);
    MS_TILE_LOAD(5, b, kPairBytes);
    MS_TILE_DP(0, 4, 5);
    MS_TILE_LOAD(6, b + 16, kPairBytes);
    MS_TILE_DP(1, 4, 6);
    MS_TILE_LOAD(7, b + 32, kPairBytes);
    MS_TILE_DP(2, 4, 7);
    MS_TILE_LOAD(5, b + 48, kPairBytes);
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
  static void load_c(const float* c, int64_t stride) {
    for (int b = 0; b < 4; ++b)
      for (int m = 0; m < kRows; ++m)
        std::memcpy(state().c[b][m], reinterpret_cast<const char*>(c + 16 * b) + m * stride, 64);
  }
  static void store_c(float* c, int64_t stride) {
    for (int b = 0; b < 4; ++b)
      for (int m = 0; m < kRows; ++m)
        std::memcpy(reinterpret_cast<char*>(c + 16 * b) + m * stride, state().c[b][m], 64);
  }
  static float widen(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static void step(const uint16_t* a, int64_t a_stride, const uint32_t* b) {
    for (int blk = 0; blk < 4; ++blk)
      for (int m = 0; m < kRows; ++m) {
        const auto* row = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(a) + m * a_stride);
        for (int n = 0; n < 16; ++n) {
          float even = 0.0f, odd = 0.0f;
          for (int k = 0; k < 16; ++k) {
            const uint32_t pair = b[k * kPanel + 16 * blk + n];
            even = std::fma(widen(row[2 * k]), widen(static_cast<uint16_t>(pair)), even);
            odd = std::fma(widen(row[2 * k + 1]), widen(static_cast<uint16_t>(pair >> 16)), odd);
          }
          float& c = state().c[blk][m][n];
          c = (c + even) + odd;
        }
      }
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
  thread_local Buf bufs[4];
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

template <class Tiles>
void panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y, int64_t ldy,
            uint32_t* pk, const uint32_t* packed) {
  using musespark_avx512::kPanelK;
  const int64_t full_blocks = M / kRows, tail_rows = M % kRows;
  const int64_t tail_k = K % kStepK;                         // the last group's real k (0: none)
  const int64_t Kpad = (K + kStepK - 1) / kStepK * kStepK;
  // The last, partial block of rows, zero-padded to 16 rows and Kpad k. The scratch is all
  // zeros between calls (its rows are zeroed again at the end), so a decode row costs a copy
  // of itself, not a clear of 16.
  uint16_t* apart = nullptr;
  if (tail_rows) {
    apart = scratch<uint16_t>(0, kRows * Kpad);
    for (int64_t r = 0; r < tail_rows; ++r) std::memcpy(apart + r * Kpad, x + (full_blocks * kRows + r) * K, K * 2);
  }
  // Each full block's last group of k, zero-padded to 32 k.
  uint16_t* atail = nullptr;
  if (tail_k && full_blocks) {
    atail = scratch<uint16_t>(1, full_blocks * kRows * kStepK);
    std::memset(atail, 0, full_blocks * kRows * kStepK * sizeof(uint16_t));
    for (int64_t r = 0; r < full_blocks * kRows; ++r)
      std::memcpy(atail + r * kStepK, x + r * K + (K - tail_k), tail_k * 2);
  }
  uint32_t* btail = scratch<uint32_t>(2, kRows * kPanel);  // the last group's pairs, zero-padded
  float* cbuf = scratch<float>(3, kRows * kPanel);         // C of a partial block
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int64_t np = n1 - n < kPanel ? n1 - n : kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kPanelK) {
      const int64_t kc = K - k0 < kPanelK ? K - k0 : kPanelK;
      const uint32_t* panel = packed ? packed + n / kPanel * (K / 2 * kPanel) + k0 / 2 * kPanel : pk;
      if (!packed) musespark_avx512::pack_panel_chunk(w + n * K, K, np, k0, kc, pk);
      const int64_t groups = kc / kStepK;  // full groups of this chunk
      const bool tail = kc % kStepK != 0;  // then the chunk is K's last, and tail_k is its rest
      if (tail) {
        std::memset(btail, 0, kRows * kPanel * sizeof(uint32_t));
        std::memcpy(btail, panel + groups * kRows * kPanel, (tail_k / 2) * kPanel * sizeof(uint32_t));
      }
      for (int64_t blk = 0; blk * kRows < M; ++blk) {
        const int64_t m0 = blk * kRows, mt = M - m0 < kRows ? M - m0 : kRows;
        const bool direct = mt == kRows && np == kPanel;  // C straight from and to y
        float* yb = y + m0 * ldy + n;
        if (k0 == 0) {
          Tiles::zero_c();
        } else if (direct) {
          Tiles::load_c(yb, ldy * 4);
        } else {
          std::memset(cbuf, 0, kRows * kPanel * sizeof(float));
          for (int64_t r = 0; r < mt; ++r) std::memcpy(cbuf + r * kPanel, yb + r * ldy, np * 4);
          Tiles::load_c(cbuf, kPanel * 4);
        }
        const uint16_t* a = mt == kRows ? x + m0 * K + k0 : apart + k0;
        const int64_t a_stride = (mt == kRows ? K : Kpad) * 2;
        for (int64_t g = 0; g < groups; ++g) Tiles::step(a + g * kStepK, a_stride, panel + g * kRows * kPanel);
        if (tail) {
          if (mt == kRows)
            Tiles::step(atail + blk * kRows * kStepK, kStepK * 2, btail);
          else
            Tiles::step(a + groups * kStepK, a_stride, btail);
        }
        if (direct) {
          Tiles::store_c(yb, ldy * 4);
        } else {
          Tiles::store_c(cbuf, kPanel * 4);
          for (int64_t r = 0; r < mt; ++r) std::memcpy(yb + r * ldy, cbuf + r * kPanel, np * 4);
        }
      }
    }
  }
  if (tail_rows) std::memset(apart, 0, tail_rows * Kpad * sizeof(uint16_t));
}

thread_local int tile_depth = 0;  // open tiles_begin scopes of this thread

}  // namespace

void tiles_begin() {
  if (tile_depth++ == 0 && !musespark_isa::amx_emulated()) Hardware::configure();
}

void tiles_end() {
  if (--tile_depth == 0 && !musespark_isa::amx_emulated()) Hardware::release();
}

bool request_permission() {
  // Linux (5.16+) hands out the tile data state per process on request
  // (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18); without it a tile instruction
  // faults. Asked once; the answer is kept.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed) {
  tiles_begin();  // free inside the caller's scope
  if (musespark_isa::amx_emulated())
    panels<Emulated>(x, M, K, w, n0, n1, y, ldy, pk, packed);
  else
    panels<Hardware>(x, M, K, w, n0, n1, y, ldy, pk, packed);
  tiles_end();
}

}  // namespace musespark_amx
