// Small-M linear layers on x86 CPUs with AVX2+FMA: y[M, N] = x[M, K] @ w[N, K]^T, fp32
// accumulation, shared by the kernels that multiply by weights.
//
// Why: decode multiplies a handful of rows by large weights, so it is bound by reading
// the weights. Each weight element is read once, widened to fp32 in registers (bf16 is
// the top half of an fp32) and used for all M rows of x, which sit in L1.
//
// Invariant (batch invariance): every output element is one dot product computed the
// same way (8 fp32 lanes over K in order, then `hsum`) whatever M, the tile it falls in or
// the job list it is part of, so a row's result never depends on the other rows.
//
// ISA dispatch (cpu_isa.h): on CPUs with AVX-512-BF16, products whose x and w both hold
// bf16 values run `musespark_avx512::bf16_dots` or `bf16_panels` instead (vdpbf16ps; which
// one: split_prompt_runs): the same invariance, other fixed summation orders. On CPUs with
// AMX (level kAmxBf16) the panel product runs on AMX tiles (`musespark_amx::bf16_panels`)
// for every row that would take bf16_panels.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_isa.h"
#include "cpu_nvfp4.h"
#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

namespace musespark_gemv {

using musespark_simd::hsum;
using musespark_simd::load8;

// Elements of W in one 64-byte cache line.
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);

// Software prefetch in weight_tile: rows are short streams (K elements), too short for the
// hardware prefetcher to ramp up on its own, so a 4-row tile prefetches the tile after it.
constexpr int64_t kPrefetchRows = 4;

// Weight rows per tile.
constexpr int kNR = 4;

// NR weight rows times MR input rows: NR*MR independent accumulators; y has row stride ldy.
// Adjacent tiles (Far false): weight row n at w + n * K, element (m, n) to y[m * ldy + n],
// each row's line at byte offset `ahead` from the current one prefetched. Far tiles
// (stream_rows): row n at w + n * ldw, element (m, n) to y[m * ldy + n * ldn], no prefetch.
// (A template flag: the adjacent tiles' loop stays the code it was before far tiles existed.)
template <typename W, int NR, int MR, bool Far>
inline void tile(const float* x, int64_t K, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                 int64_t ahead) {
  if constexpr (!Far) ldw = K, ldn = 1;
  __m256 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      __m256 wv = load8(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  };
  constexpr int64_t L = kLine<W>;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (!Far)
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + ahead, _MM_HINT_T0);
    for (int64_t j = 0; j < L; j += 8) step(k + j);
  }
  for (; k < K; k += 8) step(k);
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) y[m * ldy + n * ldn] = hsum(acc[n][m]);
}

// fp32 weights in fp32 models (x not bf16) accumulate in double: the
// dot product rounded once, as exact as fp32 allows (an fp32 sum over K picks up an error
// that fp32 models would carry into their logits; `benchmarks/fp32_exactness.py`). Each
// element: two 4-lane double accumulators over K in order, summed at the end.
template <int NR, int MR, bool Far>
inline void tile(const float* x, int64_t K, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                 int64_t ahead) {
  if constexpr (!Far) ldw = K, ldn = 1;
  __m256d lo[NR][MR], hi[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) lo[n][m] = hi[n][m] = _mm256_setzero_pd();
  auto step = [&](int64_t k) {
    __m256d xl[MR], xh[MR];
    for (int m = 0; m < MR; ++m) {
      xl[m] = _mm256_cvtps_pd(_mm_loadu_ps(x + m * K + k));
      xh[m] = _mm256_cvtps_pd(_mm_loadu_ps(x + m * K + k + 4));
    }
    for (int n = 0; n < NR; ++n) {
      const __m256d wl = _mm256_cvtps_pd(_mm_loadu_ps(w + n * ldw + k));
      const __m256d wh = _mm256_cvtps_pd(_mm_loadu_ps(w + n * ldw + k + 4));
      for (int m = 0; m < MR; ++m) {
        lo[n][m] = _mm256_fmadd_pd(wl, xl[m], lo[n][m]);
        hi[n][m] = _mm256_fmadd_pd(wh, xh[m], hi[n][m]);
      }
    }
  };
  constexpr int64_t L = kLine<float>;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (!Far)
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + ahead, _MM_HINT_T0);
    for (int64_t j = 0; j < L; j += 8) step(k + j);
  }
  for (; k < K; k += 8) step(k);
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) {
      const __m256d v = _mm256_add_pd(lo[n][m], hi[n][m]);
      __m128d t = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
      t = _mm_add_sd(t, _mm_unpackhi_pd(t, t));
      y[m * ldy + n * ldn] = static_cast<float>(_mm_cvtsd_f64(t));
    }
}

// bf16 weights, and fp32 weights against bf16 values (a bf16 model's fp32 router): the fp32
// tile; fp32 weights in an fp32 model: the double-accumulating one.
template <typename W, int NR, int MR, bool Far>
inline void tile_of(const float* x, int64_t K, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t ldn,
                    int64_t ahead, bool x_bf16) {
  if constexpr (std::is_same_v<W, float>) {
    if (!x_bf16) return tile<NR, MR, Far>(x, K, w, ldw, y, ldy, ldn, ahead);
  }
  tile<W, NR, MR, Far>(x, K, w, ldw, y, ldy, ldn, ahead);
}

// NR weight rows (as in tile) against all M rows of x: 4x3 tiles reuse each loaded weight
// (4x3 vs 4x2: 104-126 vs 86-91 GFLOP/s at M = 64 and 512, benchmarks/RESULTS.md), the
// last one or two rows in a shorter tile.
template <typename W, int NR, bool Far>
inline void tile_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, float* y, int64_t ldy,
                      int64_t ldn, int64_t ahead, bool x_bf16) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_of<W, NR, 3, Far>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead, x_bf16);
  if (m + 2 <= M)
    tile_of<W, NR, 2, Far>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead, x_bf16);
  else if (m < M)
    tile_of<W, NR, 1, Far>(x + m * K, K, w, ldw, y + m * ldy, ldy, ldn, ahead, x_bf16);
}

// Weight rows [n0, n0 + kNR) (fewer at the end) against all M rows of x, each weight tile
// prefetching the next.
template <typename W>
inline void weight_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0, float* y,
                        int64_t ldy, bool x_bf16) {
  const int64_t ahead = kPrefetchRows * K * static_cast<int64_t>(sizeof(W));
  if (n0 + kNR <= N) {
    tile_rows<W, kNR, false>(x, M, K, w + n0 * K, K, y + n0, ldy, 1, ahead, x_bf16);
  } else {
    for (int64_t r = n0; r < N; ++r) tile_rows<W, 1, false>(x, M, K, w + r * K, K, y + r, ldy, 1, ahead, x_bf16);
  }
}

// Weight rows [n0, n1) (whole tiles but the last) against all M rows of x (more than
// kStreamMaxRows: fewer take stream_rows), x taken in blocks of about kXBlockBytes: each
// block stays in L2 while every weight tile of the range passes over it. Why: a tile reads
// each x row once for 2 * kNR flops per fp32 value, so streaming all of a prompt's x from L3
// (or memory) once per tile bounded the products by that traffic (AVX2 path on the AMX Xeon,
// 2048 rows: ~120 GFLOP/s, ~160 in blocks, ~172 for the tile on warm data alone;
// benchmarks/RESULTS.md, session 26).
// Each element is its tile's sum whatever the block (one FMA chain over K, then hsum), so
// only the order in which outputs are written changes.
constexpr int64_t kXBlockBytes = 256 * 1024;
template <typename W>
inline void weight_tiles(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0, int64_t n1,
                         float* y, int64_t ldy, bool x_bf16) {
  const int64_t block = std::max<int64_t>(3, kXBlockBytes / (4 * K) / 3 * 3);  // whole 3-row tiles
  for (int64_t m0 = 0; m0 < M; m0 += block)
    for (int64_t n = n0; n < n1; n += kNR)
      weight_tile(x + m0 * K, std::min(block, M - m0), K, w, N, n, y + m0 * ldy, ldy, x_bf16);
}

// Weight rows [n0, n1) against a few rows of x, the weight read as kRowStreams sequential
// streams in lockstep: with q = (n1 - n0) / kRowStreams, step i multiplies rows n0 + i,
// n0 + q + i, n0 + 2q + i, ... (one tile whose rows are q apart; the last
// (n1 - n0) % kRowStreams rows one at a time). Each element is the tiles' sum (one 8-lane FMA
// chain over K in order, then hsum), so nothing changes but the speed. Why: one row of x
// through one weight row at a time is one FMA chain, 8 weights per FMA latency, ~15 GB/s of
// bf16 on one core even from cache; tiles of adjacent rows interleave short streams that
// the prefetchers follow badly (10-15 GB/s at 2-8 rows of x on two cores); rows far apart
// are long streams that they follow, with no software prefetch (benchmarks/RESULTS.md,
// session 22). Taken by products of at most kStreamMaxRows rows on these tiles (bf16 weights
// on the AVX2 path, fp32 weights on every path); from 4 rows the adjacent tiles, which
// prefetch the next tile, were as fast.
constexpr int kRowStreams = 4;
constexpr int64_t kStreamMaxRows = 3;
template <typename W>
inline void stream_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                        int64_t ldy, bool x_bf16) {
  const int64_t q = (n1 - n0) / kRowStreams;
  for (int64_t i = 0; i < q; ++i)
    tile_rows<W, kRowStreams, true>(x, M, K, w + (n0 + i) * K, q * K, y + n0 + i, ldy, q, 0, x_bf16);
  for (int64_t n = n0 + kRowStreams * q; n < n1; ++n) tile_rows<W, 1, true>(x, M, K, w + n * K, K, y + n, ldy, 1, 0, x_bf16);
}

// One product y[M, N] (row stride ldy) = x[M, K] @ w[N, K]^T; w is bf16 or fp32, or
// NVFP4 (`scales` set; cpu_nvfp4.cpp states the numerics): w = codes uint8 [N, K/2],
// scales e4m3 bytes [N, K/16], G global scales, rows [g N/G, (g+1) N/G) using globals[g].
// x_bf16: every x value is a bf16 value (the fused blocks round what they multiply), so
// the product may run on bf16 hardware without changing any input; for NVFP4 it also
// means the model is bf16, so the decoded weights are rounded to bf16 as the reference does.
struct Job {
  const float* x;
  int64_t M, K;
  const void* w;
  bool w_bf16;
  int64_t N;
  float* y;
  int64_t ldy;
  bool x_bf16 = true;
  const uint8_t* scales = nullptr;
  const float* globals = nullptr;
  int64_t G = 1;
  // Per row of x: nonzero for a prompt row (`split_prompt_runs`); null: none is.
  const uint8_t* prompt = nullptr;
  // A bf16 weight's panels, packed once (`panels_arg`): then every row takes bf16_panels.
  const uint32_t* packed = nullptr;
  bool panels = false;  // every row is multiplied by bf16_panels (prompt rows, or packed weights)
  int64_t tile_rows() const { return panels ? musespark_avx512::kPanelRows : kNR; }
  int64_t tiles() const { return (N + tile_rows() - 1) / tile_rows(); }
  bool nvfp4() const { return scales != nullptr; }
  bool avx512() const { return !nvfp4() && w_bf16 && x_bf16 && musespark_isa::avx512_bf16(); }
  // At most kStreamMaxRows rows of x on the fp32 tiles (bf16 weights on the AVX2 path, fp32
  // weights on every path): stream_rows.
  bool fp32_tiles() const { return !nvfp4() && !avx512(); }
  bool row_streams() const { return M >= 1 && M <= kStreamMaxRows && fp32_tiles(); }
  // More rows on the fp32 tiles: weight_tiles, x in blocks.
  bool row_blocks() const { return M > kStreamMaxRows && fp32_tiles(); }
};

// What the NVFP4 jobs of one run_jobs call share: x permuted to the decode order (one copy
// per distinct x) and each job's magnitude tables.
struct Nvfp4Inputs {
  std::vector<std::vector<float>> x;
  std::vector<std::vector<const float*>> tables;  // per job: one table per global scale
  std::vector<std::vector<float>> spill;            // tables the process-wide cache had no room for
  std::vector<int> which;                  // per job: its permuted x, or -1
};

inline Nvfp4Inputs nvfp4_inputs(const std::vector<Job>& jobs) {
  Nvfp4Inputs in;
  in.tables.resize(jobs.size());
  in.which.assign(jobs.size(), -1);
  const bool avx512 = musespark_isa::avx512_bf16();
  std::vector<const float*> seen;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& b = jobs[j];
    if (!b.nvfp4() || b.M == 0) continue;
    for (int64_t g = 0; g < b.G; ++g) {
      in.spill.emplace_back();
      in.tables[j].push_back(musespark_nvfp4::table_for(b.globals[g], b.x_bf16, avx512, in.spill.back()));
    }
    for (size_t i = 0; i < seen.size(); ++i)
      if (seen[i] == b.x && in.x[i].size() == static_cast<size_t>(b.M * b.K)) in.which[j] = static_cast<int>(i);
    if (in.which[j] >= 0) continue;
    in.which[j] = static_cast<int>(in.x.size());
    seen.push_back(b.x);
    in.x.push_back(musespark_nvfp4::permute_x(b.x, b.M, b.K, avx512));
  }
  return in;
}

// Rows [n0, n1) of an NVFP4 job.
inline void nvfp4_rows(const Job& b, const Nvfp4Inputs& in, size_t j, int64_t n0, int64_t n1) {
  const float* xp = in.x[in.which[j]].data();
  const auto* codes = static_cast<const uint8_t*>(b.w);
  if (musespark_isa::avx512_bf16())
    musespark_avx512::nvfp4_rows(xp, b.M, b.K, codes, b.scales, in.tables[j].data(), b.N / b.G, b.ldy, n0, n1, b.y);
  else
    musespark_nvfp4::rows(xp, b.M, b.K, codes, b.scales, in.tables[j].data(), b.N / b.G, b.ldy, n0, n1, b.y);
}

// x as bf16 bits (exact: x_bf16 says every value is one), one copy per distinct x, in the
// calling thread's buffers (kept across calls and only grown: a prompt's x is megabytes,
// and fresh ones would be zeroed and faulted in on every call). Valid until its next call.
inline std::vector<uint16_t*> bf16_inputs(const std::vector<Job>& jobs, std::vector<int>& which) {
  static thread_local std::vector<std::vector<uint16_t>> buffers;
  std::vector<uint16_t*> out;
  std::vector<const float*> seen;
  std::vector<int64_t> sizes;
  which.assign(jobs.size(), -1);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& b = jobs[j];
    if (!b.avx512() || b.M == 0) continue;
    for (size_t i = 0; i < seen.size(); ++i)
      if (seen[i] == b.x && sizes[i] == b.M * b.K) which[j] = static_cast<int>(i);
    if (which[j] >= 0) continue;
    if (buffers.size() <= out.size()) buffers.emplace_back();
    std::vector<uint16_t>& xb = buffers[out.size()];
    if (static_cast<int64_t>(xb.size()) < b.M * b.K) xb.resize(b.M * b.K);
    musespark_simd::to_bf16_bits(b.x, xb.data(), b.M * b.K);
    which[j] = static_cast<int>(out.size());
    seen.push_back(b.x);
    sizes.push_back(b.M * b.K);
    out.push_back(xb.data());
  }
  return out;
}

// Batch invariance with two bf16 kernels (AVX-512-BF16). A weight packed once into panels
// (`Job::packed`: the dense linears, the LM head, and the experts where the backend packs
// them: backends/cpu_args.py) multiplies every row by bf16_panels,
// which reads it as one stream and is the faster kernel at every batch size. Otherwise a
// prompt row (a token inside its request's prompt: the caller says which) is multiplied by
// bf16_panels, packing the weight on the fly, and every other row (decode, speculative
// verification) by bf16_dots, which streams the weight at one row. A row's kernel depends on
// the weight and the row alone, never on its batch, so neither does its result. A job's rows
// split into runs of one kind, one job per run; jobs on other paths drop the flags.
inline std::vector<Job> split_prompt_runs(const std::vector<Job>& jobs) {
  std::vector<Job> out;
  out.reserve(jobs.size());
  for (const Job& b : jobs) {
    Job c = b;
    c.prompt = nullptr;
    if (b.packed && b.avx512()) {
      c.panels = true;
      out.push_back(c);
      continue;
    }
    if (!b.prompt || !b.avx512()) {
      out.push_back(c);
      continue;
    }
    for (int64_t r0 = 0, r1 = 0; r0 < b.M; r0 = r1) {
      const bool kind = b.prompt[r0] != 0;
      for (r1 = r0 + 1; r1 < b.M && (b.prompt[r1] != 0) == kind;) ++r1;
      c.x = b.x + r0 * b.K;
      c.y = b.y + r0 * b.ldy;
      c.M = r1 - r0;
      c.panels = kind;
      out.push_back(c);
    }
  }
  return out;
}

// The calling thread's packing scratch for bf16_panels (kPanelWords, 64-byte aligned).
inline uint32_t* panel_scratch() {
  thread_local std::vector<uint32_t> buf(musespark_avx512::kPanelWords + 16);
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<uint32_t*>((addr + 63) / 64 * 64);
}

// Weight rows [n0, n1) of a bf16 job (`avx512()`), x given as bf16 bits: the panel kernel
// for panel jobs (split_prompt_runs; on AMX tiles on the amx_bf16 path), else the
// dot-product kernel (which chunks x itself).
inline void bf16_rows(const Job& b, const uint16_t* xb, int64_t n0, int64_t n1) {
  const auto* w = static_cast<const uint16_t*>(b.w);
  if (b.panels && musespark_isa::amx())
    musespark_amx::bf16_panels(xb, b.M, b.K, w, n0, n1, b.y, b.ldy, panel_scratch(), b.packed);
  else if (b.panels)
    musespark_avx512::bf16_panels(xb, b.M, b.K, w, n0, n1, b.y, b.ldy, panel_scratch(), b.packed);
  else
    musespark_avx512::bf16_dots(xb, b.M, b.K, w, n0, n1, b.y, b.ldy);
}

// The AMX tile configuration held by this thread while it runs a stretch of panel products
// (musespark_amx::tiles_begin; nothing on the other paths or when no job takes the panels).
class TileScope {
 public:
  explicit TileScope(bool needed) : on_(needed && musespark_isa::amx()) {
    if (on_) musespark_amx::tiles_begin();
  }
  ~TileScope() {
    if (on_) musespark_amx::tiles_end();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  bool on_;
};

// run_jobs runs several products in one parallel region (one thread wake-up, one stream of
// weight tiles split across threads: each thread reads its own contiguous slice, and the
// first done takes the last chunks of the others': TileRange).
// Without batch invariance (cpu_isa.h), bf16 products of at least this many rows go to
// oneDNN's bf16 GEMM (at::mm; AMX tiles where the CPU has them) instead of bf16_dots.
constexpr int64_t kOnednnMinRows = 64;

// y = bf16(x @ w^T) by at::mm, widened into the fp32 rows of y (the callers round every
// bf16 product's output to bf16, so one rounding here changes nothing they keep).
inline void onednn_job(const Job& b, uint16_t* xb) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const at::Tensor x = at::from_blob(xb, {b.M, b.K}, bf16);
  const at::Tensor w = at::from_blob(const_cast<void*>(b.w), {b.N, b.K}, bf16);
  const at::Tensor y = at::mm(x, w.t()).to(at::kFloat);
  at::from_blob(b.y, {b.M, b.N}, {b.ldy, 1}, at::TensorOptions().dtype(at::kFloat)).copy_(y);
}

// The tiles [bounds[p], bounds[p + 1]) of each of `parts` contiguous parts (the threads'
// starting shares), of near-equal cost: a tile of job j costs K (kTileFixedRows + M), its
// weight reads counted as that many rows of x (jobs of one call differ in M: the experts of
// a MoE). Where a tile runs never changes what it computes.
constexpr int64_t kTileFixedRows = 8;
constexpr int64_t kMinParallelRows = 16 * kNR;  // products of fewer weight rows run on the calling thread
inline double tile_cost(const Job& b) {
  return static_cast<double>(b.K) * static_cast<double>(kTileFixedRows + b.M) * static_cast<double>(b.tile_rows());
}
// The cost of all tiles of the jobs (first: each job's first tile, then the end).
inline double total_cost(const std::vector<Job>& jobs, const std::vector<int64_t>& first) {
  double total = 0;
  for (size_t j = 0; j < jobs.size(); ++j) total += static_cast<double>(first[j + 1] - first[j]) * tile_cost(jobs[j]);
  return total;
}
inline std::vector<int64_t> split_tiles(const std::vector<Job>& jobs, const std::vector<int64_t>& first, int64_t parts) {
  const double total = total_cost(jobs, first);
  std::vector<int64_t> bounds{0};
  double done = 0;
  for (size_t j = 0; j < jobs.size() && static_cast<int64_t>(bounds.size()) < parts; ++j) {
    const double per = tile_cost(jobs[j]);
    for (int64_t t = first[j]; t < first[j + 1] && static_cast<int64_t>(bounds.size()) < parts; ++t) {
      done += per;
      if (done >= total * static_cast<double>(bounds.size()) / static_cast<double>(parts)) bounds.push_back(t + 1);
    }
  }
  while (static_cast<int64_t>(bounds.size()) <= parts) bounds.push_back(first.back());
  return bounds;
}

// Work stealing between the parts of a region: part p's tiles [next, end) packed in one
// atomic word. Its thread takes chunks from the front (one forward stream, as with a static
// split); a thread whose own parts are done takes chunks from the back of the part with the
// most tiles left. Why: the two vCPUs of the machines measured do not stream at one rate (one
// often finished 15-20 % of a region's time early and waited: benchmarks/RESULTS.md, session
// 16). Where a tile runs never changes what it computes, so no result changes.
class TileRange {
 public:
  void reset(int64_t next, int64_t end) {
    TORCH_CHECK(next >= 0 && end < (int64_t{1} << 32), "run_jobs: ", end,
                " weight tiles in one call; at most 2^32 - 1 fit");
    v_.store(pack(next, end));
  }
  int64_t left() const {
    const uint64_t x = v_.load(std::memory_order_relaxed);
    return std::max<int64_t>(0, end_of(x) - next_of(x));
  }
  // Up to c tiles [a, b) from the front (the owner) or the back (a thief); false when empty.
  bool take_front(int64_t c, int64_t& a, int64_t& b) { return take(c, true, a, b); }
  bool take_back(int64_t c, int64_t& a, int64_t& b) { return take(c, false, a, b); }

 private:
  static uint64_t pack(int64_t next, int64_t end) {
    return (static_cast<uint64_t>(next) << 32) | static_cast<uint64_t>(end);
  }
  static int64_t next_of(uint64_t x) { return static_cast<int64_t>(x >> 32); }
  static int64_t end_of(uint64_t x) { return static_cast<int64_t>(x & 0xffffffffu); }
  bool take(int64_t c, bool front, int64_t& a, int64_t& b) {
    uint64_t x = v_.load();
    for (;;) {
      const int64_t n = next_of(x), e = end_of(x);
      if (n >= e) return false;
      const uint64_t rest = front ? pack(std::min(e, n + c), e) : pack(n, std::max(n, e - c));
      if (v_.compare_exchange_weak(x, rest)) {
        a = front ? n : end_of(rest), b = front ? next_of(rest) : e;
        return true;
      }
    }
  }
  alignas(64) std::atomic<uint64_t> v_{0};  // one cache line per part: owners never contend
};

// Tiles per take: about kStealCost of work (split_tiles' units; 64 KiB of bf16 weights at one
// row of x), at least one tile. Small enough that the last takes even out the parts, large
// enough that each is one stretch of the weight stream.
// A region whose products all take stream_rows takes kRowStreams times as much (at one row
// of x: 256 KiB of bf16 weights, four 64 KiB streams). Batch-1 decode on the AVX2 path, in one
// process with the settings alternated: streams in these takes 1.19x, in twice as large
// 1.18x; the larger takes alone (no streams) 0.99x. (A region that mixes them, a bf16 model's
// fp32 router beside packed panels on the AVX-512 path, keeps the panels' takes.)
// On the AMX path a region with a job of at least musespark_amx::kSuperRows rows takes at
// least kSuperTakes panels at a time: the tile kernel keeps a superblock of rows in L2
// across the panels of one call (cpu_amx.cpp). In one process, alternated run by run: a
// 2048-token prompt and 8 prompts of 128 tokens 1.03x faster (benchmarks/RESULTS.md,
// session 24).
// A region whose products all run on the fp32 tiles, one of them weight_tiles with x larger
// than a block, takes at least kBlockTiles tiles at a time (64 weight rows), so that each
// block of x read into L2 serves that many tiles. (A region that mixes them, a bf16 model's
// fp32 router beside packed panels, keeps the panels' takes: the router's x then streams once
// per tile, as before.)
constexpr double kStealCost = 9.0 * 32768;
constexpr int64_t kSuperTakes = 4;
constexpr int64_t kBlockTiles = 16;
inline int64_t steal_chunk(const std::vector<Job>& jobs, const std::vector<int64_t>& first) {
  const double per_tile = total_cost(jobs, first) / static_cast<double>(std::max<int64_t>(1, first.back()));
  const bool streams =
      std::all_of(jobs.begin(), jobs.end(), [](const Job& b) { return b.M == 0 || b.row_streams(); });
  const double cost = streams ? kStealCost * kRowStreams : kStealCost;
  const bool superblocks = musespark_isa::amx() && std::any_of(jobs.begin(), jobs.end(), [](const Job& b) {
    return b.packed != nullptr && b.M >= musespark_amx::kSuperRows;  // superblocks need packed panels
  });
  const bool blocks =
      std::all_of(jobs.begin(), jobs.end(), [](const Job& b) { return b.M == 0 || b.fp32_tiles(); }) &&
      std::any_of(jobs.begin(), jobs.end(),
                  [](const Job& b) { return b.row_blocks() && 4 * b.M * b.K > kXBlockBytes; });
  const int64_t least = blocks ? kBlockTiles : superblocks ? kSuperTakes : 1;
  return std::max<int64_t>(least, static_cast<int64_t>(cost / std::max(per_tile, 1.0)));
}

inline void run_jobs(const std::vector<Job>& given) {
  const std::vector<Job> all = split_prompt_runs(given);
  std::vector<int> which;
  const std::vector<uint16_t*> xb = bf16_inputs(all, which);
  // Prompt-sized bf16 products by oneDNN first (each at::mm uses every thread), when allowed.
  std::vector<Job> jobs = all;
  if (!musespark_isa::batch_invariant())
    for (size_t j = 0; j < jobs.size(); ++j)
      if (which[j] >= 0 && jobs[j].M >= kOnednnMinRows) {
        onednn_job(jobs[j], xb[which[j]]);
        jobs[j].M = 0;
        which[j] = -1;
      }
  std::vector<int64_t> first(jobs.size() + 1, 0);  // first tile of each job
  int64_t weight_rows = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    first[j + 1] = first[j] + (jobs[j].M > 0 ? jobs[j].tiles() : 0);
    weight_rows += jobs[j].M > 0 ? jobs[j].N : 0;
  }
  const Nvfp4Inputs q = nvfp4_inputs(jobs);
  const std::vector<int64_t> bounds =
      split_tiles(jobs, first, weight_rows > kMinParallelRows ? at::get_num_threads() : 1);
  // Tiles [t0, t1) of the region, any range (run by whichever thread takes it).
  auto run_tiles = [&](int64_t t0, int64_t t1) {
    if (t0 >= t1) return;
    size_t j = std::upper_bound(first.begin(), first.end(), t0) - first.begin() - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first[j + 1]) ++j;
      const Job& b = jobs[j];
      const int64_t n0 = (t - first[j]) * b.tile_rows();
      // This job's tiles in [t, t1), in one call.
      const int64_t t_end = std::min(t1, first[j + 1]);
      const int64_t n1 = std::min(b.N, (t_end - first[j]) * b.tile_rows());
      const auto* w16 = static_cast<const at::BFloat16*>(b.w);
      const auto* w32 = static_cast<const float*>(b.w);
      if (b.nvfp4())
        nvfp4_rows(b, q, j, n0, n1);
      else if (which[j] >= 0)
        bf16_rows(b, xb[which[j]], n0, n1);
      else if (b.row_streams() && b.w_bf16)
        stream_rows(b.x, b.M, b.K, w16, n0, n1, b.y, b.ldy, b.x_bf16);
      else if (b.row_streams())
        stream_rows(b.x, b.M, b.K, w32, n0, n1, b.y, b.ldy, b.x_bf16);
      else if (b.w_bf16)
        weight_tiles(b.x, b.M, b.K, w16, b.N, n0, n1, b.y, b.ldy, b.x_bf16);
      else
        weight_tiles(b.x, b.M, b.K, w32, b.N, n0, n1, b.y, b.ldy, b.x_bf16);
      t = t_end - 1;
    }
  };
  bool panels = false;
  for (size_t j = 0; j < jobs.size(); ++j) panels = panels || (which[j] >= 0 && jobs[j].panels);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  if (parts == 1) {
    TileScope tiles(panels);
    return run_tiles(bounds[0], bounds[1]);
  }
  std::vector<TileRange> ranges(parts);
  for (int64_t p = 0; p < parts; ++p) ranges[p].reset(bounds[p], bounds[p + 1]);
  const int64_t chunk = steal_chunk(jobs, first);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    TileScope tiles(panels);
    int64_t a = 0, b = 0;
    for (int64_t p = p0; p < p1; ++p)
      while (ranges[p].take_front(chunk, a, b)) run_tiles(a, b);
    for (;;) {  // then from the back of the part with the most tiles left
      int64_t victim = -1, most = 0;
      for (int64_t p = 0; p < parts; ++p)
        if (const int64_t left = ranges[p].left(); left > most) most = left, victim = p;
      if (victim < 0) break;
      if (ranges[victim].take_back(chunk, a, b)) run_tiles(a, b);
    }
  });
}

// All of one bf16 job (`avx512()`) on the calling thread, for callers that split their work
// into whole jobs across the threads themselves (inside their own parallel region). The same
// kernels and tiles as run_jobs, so the same results; with batch invariance off, run_jobs
// would hand prompt-sized products to oneDNN, so callers use this only when it is on.
inline void run_job_here(const Job& given) {
  TORCH_CHECK(given.avx512() && musespark_isa::batch_invariant(), "run_job_here: a bf16 job on the avx512_bf16 path");
  thread_local std::vector<uint16_t> xb;
  TileScope tiles(true);
  for (const Job& b : split_prompt_runs({given})) {
    if (b.M == 0) continue;
    if (static_cast<int64_t>(xb.size()) < b.M * b.K) xb.resize(b.M * b.K);
    musespark_simd::to_bf16_bits(b.x, xb.data(), b.M * b.K);
    bf16_rows(b, xb.data(), 0, b.N);
  }
}

// The ops' optional `prompt_rows` argument: bool or uint8 [T], true for a row that is a
// token of its request's prompt (split_prompt_runs). Null when absent.
inline const uint8_t* prompt_flags(const c10::optional<at::Tensor>& rows, int64_t T, const char* op) {
  if (!rows.has_value() || !rows->defined()) return nullptr;
  const at::Tensor& r = *rows;
  TORCH_CHECK(r.dim() == 1 && r.size(0) == T && r.is_contiguous() &&
                  (r.scalar_type() == at::kBool || r.scalar_type() == at::kByte),
              op, ": prompt_rows must be a contiguous bool or uint8 [", T, "] (one flag per row), got ",
              r.scalar_type(), " ", r.sizes());
  return static_cast<const uint8_t*>(r.data_ptr());
}

// A bf16 weight's panels argument (the ops' optional `panels`; an expert weight's second
// part): for w [N, K], int32 [ceil(N / 64), K / 2, 64], panel p's K / 2 * 64 words holding
// the pairs (w[64p + c, 2q], w[64p + c, 2q + 1]) in the panel layout of cpu_isa.h, rows past
// N zero; for experts w [E, N, K], each expert's panels in turn, [E, ceil(N / 64), K / 2, 64]
// (kernels/cpu.py pack_panels makes both). Null when absent.
inline const uint32_t* panels_arg(const c10::optional<at::Tensor>& panels, const at::Tensor& w, const char* name) {
  if (!panels.has_value() || !panels->defined()) return nullptr;
  const at::Tensor& p = *panels;
  const bool experts = w.dim() == 3;
  TORCH_CHECK((w.dim() == 2 || experts) && w.scalar_type() == at::kBFloat16, name,
              ": panels go with a bfloat16 [N, K] weight (experts: [E, N, K]), got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(-2), K = w.size(-1);
  std::vector<int64_t> want{(N + musespark_avx512::kPanelRows - 1) / musespark_avx512::kPanelRows, K / 2,
                            musespark_avx512::kPanelRows};
  if (experts) want.insert(want.begin(), w.size(0));
  TORCH_CHECK(p.scalar_type() == at::kInt && p.is_contiguous() && p.sizes() == at::IntArrayRef(want) && K % 2 == 0,
              name, ": panels must be the contiguous int32 ", at::IntArrayRef(want),
              " packing of the weight (musespark.kernels.cpu.pack_panels), got ", p.scalar_type(), " ", p.sizes());
  return reinterpret_cast<const uint32_t*>(p.data_ptr<int32_t>());
}

// x holds bf16 values unless x_bf16 is false (see Job).
inline Job job(const float* x, int64_t M, int64_t K, const at::Tensor& w, float* y, int64_t ldy, bool x_bf16 = true) {
  return Job{x, M, K, w.data_ptr(), w.scalar_type() == at::kBFloat16, w.size(0), y, ldy, x_bf16};
}

inline void run(const float* x, int64_t M, int64_t K, const at::Tensor& w, float* y, bool x_bf16,
                const uint8_t* prompt = nullptr, const uint32_t* packed = nullptr) {
  Job b = job(x, M, K, w, y, w.size(0), x_bf16);
  b.prompt = prompt;
  b.packed = packed;
  run_jobs({b});
}

}  // namespace musespark_gemv
