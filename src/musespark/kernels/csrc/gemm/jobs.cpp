// run_jobs: the products of gemm/jobs.h in one parallel region. Each job's rows go to the
// kernel the dispatch table (common/dispatch.h) gives them, or to the AVX2 fp32 tiles
// (gemm/avx2_tiles.h); the weight tiles of all jobs are split across the threads by cost,
// and a thread done with its share takes tiles from the others'. Where a tile runs never
// changes what it computes.
#include "../common/thresholds.h"
#include "jobs.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "../common/dispatch.h"
#include "../common/isa.h"
#include "../common/simd.h"
#include "../nvfp4/nvfp4_tables.h"
#include "avx2_tiles.h"
#include "gemm_kernels.h"

namespace musespark_gemv {
namespace {

// What the NVFP4 and widened jobs of one run_jobs call share: x in the form their kernel reads
// (permuted, nvfp4/nvfp4_tables.h permute_x, or bf16 bits; one copy per distinct x and form)
// and each NVFP4 job's magnitude tables.
struct PermutedInputs {
  std::vector<std::vector<float>> x;
  // x as bf16 bits, unpermuted, for the NVFP4 jobs on the dispatch table's nvfp4_rows_bf16
  // (exact: their x holds bf16 values), one copy per distinct x.
  std::vector<std::vector<uint16_t>> xb;
  std::vector<std::vector<const float*>> tables;  // per NVFP4 job: one table per global scale
  std::vector<std::vector<float>> spill;            // tables the process-wide cache had no room for
  std::vector<int> which;                  // per job: its x in `x` (or in `xb` for nvfp4_bf16), or -1
};

// An NVFP4 job that runs on the dispatch table's nvfp4_rows_bf16: x holds bf16 values and the
// path has the kernel.
inline bool nvfp4_bf16(const Job& b) {
  return b.nvfp4() && b.x_bf16 && musespark_dispatch::kernels().nvfp4_rows_bf16 != nullptr;
}

PermutedInputs permuted_inputs(const std::vector<Job>& jobs) {
  PermutedInputs in;
  in.tables.resize(jobs.size());
  in.which.assign(jobs.size(), -1);
  const bool nvfp4_pairs = musespark_dispatch::kernels().nvfp4_pairs;
  // Per copy made: the x it came from and its kind (0: fp32 unpaired, 1: fp32 pairs, 2: bf16).
  std::vector<const float*> seen;
  std::vector<int> seen_kind;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& b = jobs[j];
    if (!(b.nvfp4() || b.widened()) || b.M == 0) continue;
    const bool pairs = b.widened() || nvfp4_pairs;  // the widened kernel reads the pairs order
    for (int64_t g = 0; b.nvfp4() && g < b.G; ++g) {
      in.spill.emplace_back();
      in.tables[j].push_back(musespark_nvfp4::table_for(b.globals[g], b.x_bf16, pairs, in.spill.back()));
    }
    const int kind = nvfp4_bf16(b) ? 2 : pairs ? 1 : 0;
    const size_t n = static_cast<size_t>(b.M * b.K);
    for (size_t i = 0; i < seen.size(); ++i)
      if (seen[i] == b.x && seen_kind[i] == kind && (kind == 2 ? in.xb[i].size() : in.x[i].size()) == n)
        in.which[j] = static_cast<int>(i);
    if (in.which[j] >= 0) continue;
    in.which[j] = static_cast<int>(in.x.size());
    seen.push_back(b.x);
    seen_kind.push_back(kind);
    // One slot per copy in both lists, the unused one left empty.
    in.x.push_back(kind == 2 ? std::vector<float>() : musespark_nvfp4::permute_x(b.x, b.M, b.K, pairs));
    in.xb.emplace_back(kind == 2 ? b.M * b.K : 0);
    if (kind == 2) musespark_simd::to_bf16_bits(b.x, in.xb.back().data(), b.M * b.K);
  }
  return in;
}

// Rows [n0, n1) of an NVFP4 job.
inline void nvfp4_rows(const Job& b, const PermutedInputs& in, size_t j, int64_t n0, int64_t n1) {
  const auto* codes = static_cast<const uint8_t*>(b.w);
  if (nvfp4_bf16(b)) {
    musespark_dispatch::kernels().nvfp4_rows_bf16(in.xb[in.which[j]].data(), b.M, b.K, codes, b.scales,
                                                  in.tables[j].data(), b.N / b.G, b.ldy, n0, n1, b.y);
    return;
  }
  musespark_dispatch::kernels().nvfp4_rows(in.x[in.which[j]].data(), b.M, b.K, codes, b.scales,
                                           in.tables[j].data(), b.N / b.G, b.ldy, n0, n1, b.y);
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
    if (!b.bf16_hw() || b.M == 0) continue;
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
    if (b.packed && b.bf16_hw()) {
      c.panels = true;
      out.push_back(c);
      continue;
    }
    if (!b.prompt || !b.bf16_hw()) {
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

// Weight rows [n0, n1) of a bf16 job (`bf16_hw()`), x given as bf16 bits: the panel kernel
// for panel jobs (split_prompt_runs; on AMX tiles on the amx_bf16 path), else the
// dot-product kernel (which chunks x itself).
inline void bf16_rows(const Job& b, const uint16_t* xb, int64_t n0, int64_t n1) {
  const auto* w = static_cast<const uint16_t*>(b.w);
  const musespark_dispatch::Kernels& k = musespark_dispatch::kernels();
  if (b.panels)
    k.bf16_panels(xb, b.M, b.K, w, n0, n1, b.y, b.ldy, panel_scratch(), b.packed);
  else
    k.bf16_dots(xb, b.M, b.K, w, n0, n1, b.y, b.ldy);
}

// The AMX tile configuration held by this thread while it runs a stretch of panel products
// (the dispatch table's tiles_begin: amx_bf16 only; nothing when no job takes the panels).
class TileScope {
 public:
  explicit TileScope(bool needed) {
    const musespark_dispatch::Kernels& k = musespark_dispatch::kernels();
    if (needed && k.tiles_begin != nullptr) {
      k.tiles_begin();
      end_ = k.tiles_end;
    }
  }
  ~TileScope() {
    if (end_ != nullptr) end_();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  musespark_dispatch::TileState end_ = nullptr;
};

// run_jobs runs several products in one parallel region (one thread wake-up, one stream of
// weight tiles split across threads: each thread reads its own contiguous slice, and the
// first done takes the last chunks of the others': TileRange).
// Without batch invariance (common/isa.h), bf16 products of at least this many rows go to
// oneDNN's bf16 GEMM (at::mm; AMX tiles where the CPU has them) instead of bf16_dots.
using musespark_rows::kOnednnMinRows;  // common/thresholds.h

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
// often finished 15-20 % of a region's time early and waited: benchmarks/RESULTS.md,
// at 8c4ecbc). Where a tile runs never changes what it computes, so no result changes.
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
// across the panels of one call (gemm/bf16_panels_amx.cpp). In one process, alternated run by run:
// a 2048-token prompt and 8 prompts of 128 tokens 1.03x faster (benchmarks/RESULTS.md, at
// 85bdf9a).
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
  const bool superblocks = musespark_dispatch::kernels().panel_superblocks && std::any_of(jobs.begin(), jobs.end(), [](const Job& b) {
    return b.packed != nullptr && b.M >= musespark_amx::kSuperRows;  // superblocks need packed panels
  });
  const bool blocks =
      std::all_of(jobs.begin(), jobs.end(), [](const Job& b) { return b.M == 0 || b.fp32_tiles(); }) &&
      std::any_of(jobs.begin(), jobs.end(),
                  [](const Job& b) { return b.row_blocks() && 4 * b.M * b.K > kXBlockBytes; });
  const int64_t least = blocks ? kBlockTiles : superblocks ? kSuperTakes : 1;
  return std::max<int64_t>(least, static_cast<int64_t>(cost / std::max(per_tile, 1.0)));
}

}  // namespace

void run_jobs(const std::vector<Job>& given) {
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
  const PermutedInputs q = permuted_inputs(jobs);
  const std::vector<int64_t> bounds =
      split_tiles(jobs, first, weight_rows > kMinParallelRows ? at::get_num_threads() : 1);
  const musespark_dispatch::Widened widened = musespark_dispatch::kernels().widened;
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
      else if (b.widened())
        widened(q.x[q.which[j]].data(), b.M, b.K, static_cast<const uint16_t*>(b.w), n0, n1, b.y, b.ldy);
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

void run_job_here(const Job& given) {
  TORCH_CHECK(given.bf16_hw() && musespark_isa::batch_invariant(),
              "run_job_here: a bf16 job on a path with bf16 products, batch invariant");
  thread_local std::vector<uint16_t> xb;
  TileScope tiles(true);
  for (const Job& b : split_prompt_runs({given})) {
    if (b.M == 0) continue;
    if (static_cast<int64_t>(xb.size()) < b.M * b.K) xb.resize(b.M * b.K);
    musespark_simd::to_bf16_bits(b.x, xb.data(), b.M * b.K);
    bf16_rows(b, xb.data(), 0, b.N);
  }
}

}  // namespace musespark_gemv
