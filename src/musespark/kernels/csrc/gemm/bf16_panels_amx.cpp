// AMX-BF16 tiles for the panel product (gemm/gemm_kernels.h declares the entry points;
// gemm/jobs.cpp
// bf16_rows says which rows take them): y[m, n] = sum_k x[m, k] w[n, k] on the same packed
// panels the AVX-512 panel kernel reads, by TDPBF16PS instead of vdpbf16ps.
//
// Why: on CPUs with AMX (Sapphire Rapids and later) one TDPBF16PS multiplies a 16 x 32 bf16
// tile of x by a 32 x 16 tile of the weight (8192 products), several times the vdpbf16ps
// rate, and prompt-sized products are compute-bound.
//
// Tiles (one configuration, every tile 16 rows x 64 bytes), two arrangements of C0-C3:
// * 2 x 2 (`step2`, pairs of full 16-row blocks): C0-C3 the 32 x 32 fp32 outputs of 32 rows
//   of x against half a panel (C0, C1: rows 0-15, columns 0-15 and 16-31; C2, C3: rows
//   16-31), A0 and A1 the two blocks' next 32 k, B0 and B1 the half panel's next 16 k pairs;
// * 1 x 4 (`step`, a single or partial block): C_b the block against panel columns
//   16b..16b+15, A the block's next 32 k, B the panel's next 16 k pairs of 16 columns.
// A is 16 rows of 32 bf16; B is 16 rows of 16 pair words: one block of a group of the panel
// layout (gemm/gemm_kernels.h), 1 KiB of consecutive memory. Why 2 x 2 where it can: a tile load costs
// about three TDPBF16PS on the Xeon measured (15.5 vs 5 ns), and 2 x 2 loads 4 tiles per 4
// products where 1 x 4 loads 5 (benchmarks/RESULTS.md, at f0fbb0f).
//
// Invariant (batch invariance): each output element starts from +0 and takes the k pairs in
// one fixed grouping, 16 pairs (32 k) per TDPBF16PS from k = 0, the last group zero-padded;
// between 1024-k chunks it is stored to y and reloaded (fp32, exact). Nothing in that depends
// on M, on which rows share a tile (a tile's rows never mix), on the arrangement (2 x 2 or
// 1 x 4), on n0/n1 or on the thread, so a row gets the same bits in any batch. The bits
// differ from the vdpbf16ps panel kernel's, so a CPU runs one or the other for every row
// (common/dispatch.h).
//
// The tile instructions, and their software model for the tests: common/amx_tiles.h.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>

#include "gemm_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,prfchw")

#include "../common/amx_tiles.h"

namespace musespark_amx {
namespace {

// Decode rows stream each packed panel from memory, one 4 KiB group of 16 k pairs per step.
// At each group they fetch the 64 lines that start half a group past it (so every line once,
// 2-6 KiB ahead of the tile loads): the hardware prefetcher alone does not run far enough
// ahead. On the Xeon measured (in one process, alternated run by run; benchmarks/RESULTS.md,
// at a5c9dba) half a group ahead made batch-1 and 8-request decode 1.05x and 1.06x faster
// than two groups ahead (the distance at f0fbb0f), and a 256 MiB weight streamed at 28.6 GB/s
// against 26.1 (a 29.1 GB/s `sum` probe). Past the last group it touches the next panel or
// past the weight (an address, not a pointer into the weight: prefetches never fault).
constexpr int64_t kGroupWords = musespark_avx512::kGroupWords;
constexpr int64_t kGroupBytes = kGroupWords * 4;
constexpr int64_t kPrefetchAhead = kGroupBytes / 2;
constexpr int64_t kNextLines = 4;  // prompt rows: lines of the next panel fetched per group (above)
inline void prefetch_group(uintptr_t address) {
  for (int64_t line = 0; line < kGroupBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(address + line), _MM_HINT_T0);
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
  float* cbuf = scratch<float>(3, kRows * kPanel);         // C of a partial block or half panel
  const int64_t pairs = full_blocks / 2;                   // rows [0, 32 pairs) take 2 x 2
  // Packed panels are read in one pass over K (C stays in the tiles); panels packed now, in
  // chunks of kPanelK (the scratch's size).
  const int64_t chunk = packed ? K : kPanelK;
  // Panel n's chunk at k0 (packed now unless `packed`): the 2 x 2 pairs [p0, p1), then, with
  // `rest`, the odd full block and the partial one.
  auto pass = [&](int64_t n, int64_t k0, int64_t p0, int64_t p1, bool rest) {
    const int64_t np = n1 - n < kPanel ? n1 - n : kPanel;
    const int64_t kc = K - k0 < chunk ? K - k0 : chunk;
    const uint32_t* panel = packed ? packed + n / kPanel * (K / 2 * kPanel) + k0 / 2 * kPanel : pk;
    if (!packed) musespark_avx512::pack_panel_chunk(w + n * K, K, np, k0, kc, pk);
    const int64_t groups = kc / kStepK;  // full groups of this chunk
    const bool tail = kc % kStepK != 0;  // then the chunk is K's last, and tail_k is its rest
    if (tail) {  // the last group's gp pairs, as a full group with zero pairs after them
      const int64_t gp = tail_k / 2;
      std::memset(btail, 0, kRows * kPanel * sizeof(uint32_t));
      for (int64_t b = 0; b < 4; ++b)
        std::memcpy(btail + b * kBlockWords, panel + groups * kGroupWords + 16 * gp * b, gp * 16 * sizeof(uint32_t));
    }
    // Prompt rows meet their data cold (an expert's rows, its weights and y fresh from memory):
    // each 32 x 32 block of y is fetched for writing before its products (its tile stores would
    // wait for the lines), and the first superblock's pass over a packed panel fetches the next
    // panel, kNextLines lines per group. In a C++ probe with everything evicted first (one core,
    // an expert's 256 rows x 1024 x 512): 534-615 -> 765-825 GFLOP/s; warm, and at 2048 rows x
    // 2560 x 1024, the same within the noise (benchmarks/RESULTS.md, at 42ddd67).
    const char* next = packed && p0 == 0 && n + kPanel < n1 ? reinterpret_cast<const char*>(panel + K / 2 * kPanel)
                                                            : nullptr;
    const char* next_end = next != nullptr ? next + K / 2 * kPanel * 4 : nullptr;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c0 = 0; c0 < np; c0 += 32) {  // one half panel: columns [c0, c0 + nc)
        const int64_t m0 = 2 * p * kRows, nc = np - c0 < 32 ? np - c0 : 32;
        float* yb = y + m0 * ldy + n + c0;
        for (int64_t r = 0; r < 2 * kRows; ++r) {
          __builtin_prefetch(yb + r * ldy, 1, 3);
          __builtin_prefetch(yb + r * ldy + 16, 1, 3);
        }
        if (k0 == 0) {
          Tiles::zero_c();
        } else if (nc == 32) {
          Tiles::load_c2(yb, ldy * 4);
        } else {
          std::memset(cbuf, 0, 2 * kRows * 32 * sizeof(float));
          for (int64_t r = 0; r < 2 * kRows; ++r) std::memcpy(cbuf + r * 32, yb + r * ldy, nc * 4);
          Tiles::load_c2(cbuf, 32 * 4);
        }
        const uint16_t* a = x + m0 * K + k0;
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t l = 0; l < kNextLines && next < next_end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T0);
          Tiles::step2(a + g * kStepK, a + kRows * K + g * kStepK, K * 2,
                       panel + g * kGroupWords + c0 / 16 * kBlockWords);
        }
        if (tail) {
          const uint16_t* at = atail + 2 * p * kRows * kStepK;
          Tiles::step2(at, at + kRows * kStepK, kStepK * 2, btail + c0 / 16 * kBlockWords);
        }
        if (nc == 32) {
          Tiles::store_c2(yb, ldy * 4);
        } else {
          Tiles::store_c2(cbuf, 32 * 4);
          for (int64_t r = 0; r < 2 * kRows; ++r) std::memcpy(yb + r * ldy, cbuf + r * 32, nc * 4);
        }
      }
    for (int64_t blk = 2 * pairs; rest && blk * kRows < M; ++blk) {  // an odd full block, the partial one
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
      // A packed panel read first by this pass (decode-sized rows: no 2 x 2 pass before it)
      // streams from memory: the lines half a group ahead are fetched now.
      const bool stream = packed != nullptr && pairs == 0 && blk == 0;
      for (int64_t g = 0; g < groups; ++g) {
        if (stream) prefetch_group(reinterpret_cast<uintptr_t>(panel) + g * kGroupBytes + kPrefetchAhead);
        Tiles::step(a + g * kStepK, a_stride, panel + g * kGroupWords);
      }
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
  };
  // Rows in superblocks of kSuperRows (2 x 2 pairs), each against every panel of the call
  // before the next (packed panels only: panels packed now are packed once per panel): the
  // superblock's rows (256 x K bf16) stay in L2 across the panels, where all M rows would
  // not (run_jobs takes several panels at a time for such rows: gemm/jobs.cpp steal_chunk). The
  // order of the passes changes no sum.
  const int64_t super_pairs = kSuperRows / (2 * kRows);
  const int64_t passes_over = pairs > 0 ? pairs : 1;  // decode rows: one pass, no pairs
  const int64_t super = packed && pairs > super_pairs ? super_pairs : passes_over;
  for (int64_t p0 = 0; p0 < passes_over; p0 += super) {
    const int64_t p1 = pairs < p0 + super ? pairs : p0 + super;
    for (int64_t n = n0; n < n1; n += kPanel)
      for (int64_t k0 = 0; k0 < K; k0 += chunk) pass(n, k0, p0, p1, p1 == pairs);
  }
  if (tail_rows) std::memset(apart, 0, tail_rows * Kpad * sizeof(uint16_t));
}

}  // namespace

void bf16_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* y,
                 int64_t ldy, uint32_t* pk, const uint32_t* packed) {
  tiles_begin();  // free inside the caller's scope
  panels<Hardware>(x, M, K, w, n0, n1, y, ldy, pk, packed);
  tiles_end();
}

void bf16_panels_emulated(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                          float* y, int64_t ldy, uint32_t* pk, const uint32_t* packed) {
  panels<Emulated>(x, M, K, w, n0, n1, y, ldy, pk, packed);
}

}  // namespace musespark_amx
