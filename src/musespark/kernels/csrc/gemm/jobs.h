// Products with weights, y[M, N] = x[M, K] @ w[N, K]^T, as jobs: what the ops and the fused
// blocks multiply (bf16, fp32 or NVFP4 weights; fp32 accumulation), run together in one
// parallel region by run_jobs (gemm/jobs.cpp).
//
// Which kernel takes a job is the dispatch table's (common/dispatch.h): on paths with bf16
// hardware, products whose x and w both hold bf16 values run its bf16_dots or bf16_panels
// (which one: split_prompt_runs); NVFP4 weights its nvfp4_rows; other bf16 weights its widened
// kernel where it has one (the avx512 path, gemm/widened_avx512.cpp); everything else the AVX2
// fp32 tiles (gemm/avx2_tiles.h). Every kernel computes each row alone in a fixed order, so a
// row's result never depends on the other rows of its batch.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "../common/dispatch.h"
#include "../common/thresholds.h"
#include "gemm_kernels.h"

namespace musespark_gemv {

// Weight rows per tile of the AVX2 fp32 tiles (gemm/avx2_tiles.h).
constexpr int kNR = 4;
// Products of at most this many rows on the fp32 tiles read the weight as far-apart streams
// (gemm/avx2_tiles.h stream_rows).
using musespark_rows::kStreamMaxRows;  // common/thresholds.h

// One product y[M, N] (row stride ldy) = x[M, K] @ w[N, K]^T; w is bf16 or fp32, or
// NVFP4 (`scales` set; nvfp4/nvfp4_linear.cpp states the numerics): w = codes uint8 [N, K/2],
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
  // x and w both bf16 on a path with bf16 hardware: bf16_dots or bf16_panels (split_prompt_runs).
  bool bf16_hw() const { return !nvfp4() && w_bf16 && x_bf16 && musespark_dispatch::bf16_products(); }
  // At most kStreamMaxRows rows of x on the fp32 tiles (bf16 weights on the AVX2 path, fp32
  // weights on every path): stream_rows.
  bool fp32_tiles() const { return !nvfp4() && !bf16_hw(); }
  bool row_streams() const { return M >= 1 && M <= kStreamMaxRows && fp32_tiles(); }
  // More rows on the fp32 tiles: weight_tiles, x in blocks.
  bool row_blocks() const { return M > kStreamMaxRows && fp32_tiles(); }
  // bf16 weights on the fp32 tiles of a path with the 16-lane kernel (the dispatch table's
  // `widened`; K % 16 == 0): x goes to it permuted to the pairs order.
  bool widened() const {
    return fp32_tiles() && w_bf16 && K % 16 == 0 && musespark_dispatch::kernels().widened != nullptr;
  }
};

// A tile of job j costs K (kTileFixedRows + M) per weight row, its weight reads counted as
// that many rows of x (gemm/jobs.cpp split_tiles; callers that split whole jobs count the same).
using musespark_rows::kTileFixedRows;  // common/thresholds.h

// Runs the jobs in one parallel region (one thread wake-up, one stream of weight tiles split
// across the threads). Each job's y rows are written once; jobs may share x.
void run_jobs(const std::vector<Job>& given);

// All of one bf16 job (`bf16_hw()`) on the calling thread, for callers that split their work
// into whole jobs across the threads themselves (inside their own parallel region). The same
// kernels and tiles as run_jobs, so the same results; with batch invariance off, run_jobs
// would hand prompt-sized products to oneDNN, so callers use this only when it is on.
void run_job_here(const Job& given);

// The ops' optional `prompt_rows` argument: bool or uint8 [T], true for a row that is a
// token of its request's prompt (split_prompt_runs). Null when absent. (gemm/job_args.cpp)
const uint8_t* prompt_flags(const c10::optional<at::Tensor>& rows, int64_t T, const char* op);

// A bf16 weight's panels argument (the ops' optional `panels`; an expert weight's second
// part): for w [N, K], int32 [ceil(N / 64), K / 2, 64], panel p's K / 2 * 64 words holding
// the pairs (w[64p + c, 2q], w[64p + c, 2q + 1]) in the panel layout of gemm/gemm_kernels.h,
// rows past N zero; for experts w [E, N, K], each expert's panels in turn,
// [E, ceil(N / 64), K / 2, 64] (kernels/cpu.py pack_panels makes both). Null when absent.
// (gemm/job_args.cpp)
const uint32_t* panels_arg(const c10::optional<at::Tensor>& panels, const at::Tensor& w, const char* name);

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
