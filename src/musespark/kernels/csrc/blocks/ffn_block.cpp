// Fused feed-forward blocks `ffn_dense` and `ffn_moe` (see blocks/block.h).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../common/dispatch.h"
#include "../common/isa.h"
#include "../common/ops.h"
#include "../common/pool.h"
#include "../gemm/jobs.h"
#include "block.h"
#include "tp_comm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

using namespace musespark_block;

constexpr float kRouterEps = 1e-15f;  // added to the sum of the chosen scores

// act = bf16(bf16(silu(gate)) * up) over n rows of [gate | up] (2I wide: the products' fp32
// outputs, taken as the model's values, bf16(gate) and bf16(up); an fp32 model rounds nothing).
// silu(g) = g / (1 + exp(-g)) with the fused blocks' exp (common/simd.h); I % 8 == 0.
void swiglu(const float* gu, int64_t n, int64_t I, float* act, bool bf16) {
  using namespace musespark_simd;
  auto r16 = [bf16](__m256 v) { return bf16 ? round_bf16_8(v) : v; };
  at::parallel_for(0, n, kRowGrain, [&](int64_t r0, int64_t r1) {
    if (!bf16) {  // fp32: silu(gate) * up in double, rounded once
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < I; ++i) {
          const double gate = gu[r * 2 * I + i], up = gu[r * 2 * I + I + i];
          act[r * I + i] = static_cast<float>(gate / (1.0 + std::exp(-gate)) * up);
        }
      return;
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 gate = r16(_mm256_loadu_ps(gu + r * 2 * I + i)), up = r16(_mm256_loadu_ps(gu + r * 2 * I + I + i));
        _mm256_storeu_ps(act + r * I + i, r16(_mm256_mul_ps(r16(silu8(gate)), up)));
      }
  });
}

}  // namespace

namespace musespark_ops {  // entry point: common/ops.h

using namespace musespark_block;

// s [T, H] fp32 -> s' [T, H] fp32, a dense SwiGLU MLP:
//   f = bf16(rms(s) * pre_gain);  b = bf16(bf16(silu(bf16(f Wg^T)) * bf16(f Wu^T)) Wd^T);
//   s' = alpha * s + beta * rms(b * post_gain)   (the input-scaled post-norm, post_eps).
Tensor ffn_dense(const Tensor& s, const Tensor& pre_gain, double eps, at::TensorList gate_proj,
                 at::TensorList up_proj, at::TensorList down_proj, const Tensor& post_gain, double post_eps,
                 const Tensor& alpha, const Tensor& beta, bool bf16, const c10::optional<Tensor>& prompt_rows) {
  check_stream(s, "ffn_dense");
  const Weight w_gate = weight_arg(gate_proj, false, "ffn_dense: gate_proj"),
               w_up = weight_arg(up_proj, false, "ffn_dense: up_proj"),
               w_down = weight_arg(down_proj, false, "ffn_dense: down_proj");
  const int64_t T = s.size(0), H = s.size(1), I = w_gate.N;
  const uint8_t* prompt = musespark_gemv::prompt_flags(prompt_rows, T, "ffn_dense");
  check_vector(pre_gain, H, "ffn_dense: pre_gain");
  check_vector(post_gain, H, "ffn_dense: post_gain");
  check_shape(w_gate, I, H, "ffn_dense: gate_proj");
  check_shape(w_up, I, H, "ffn_dense: up_proj");
  check_shape(w_down, H, I, "ffn_dense: down_proj");
  TORCH_CHECK(I % 8 == 0, "ffn_dense: intermediate size must be a multiple of 8");
  check_residual(s, alpha, beta);
  const float* f = pre_norm(s.data_ptr<float>(), T, H, pre_gain.data_ptr<float>(), static_cast<float>(eps), bf16);
  float *gu = scratch(kGateUp, T * 2 * I), *act = scratch(kAct, T * I), *b = scratch(kOut, T * H);
  run_jobs({w_gate.job(f, T, gu, 2 * I, bf16, 0, prompt), w_up.job(f, T, gu + I, 2 * I, bf16, 0, prompt)});
  swiglu(gu, T, I, act, bf16);
  run_jobs({w_down.job(act, T, b, H, bf16, 0, prompt)});
  if (musespark_tp::blocks_reduce()) musespark_tp::all_reduce(b, T * H);  // down_proj is row-parallel
  return residual(s, b, post_gain.data_ptr<float>(), static_cast<float>(post_eps), alpha, beta, bf16);
}

}  // namespace musespark_ops

namespace {

using namespace musespark_block;

// Router for one token: scores = sigmoid(logits * multiplier); the top_k experts by
// scores + bias (ties: the lower id), returned in increasing id order with weights
// scores / (sum of chosen scores + 1e-15) * routed_scaling (the sum in that order).
void route_row(const float* logits, const float* bias, int64_t E, int64_t top_k, float multiplier, float scaling,
               float* scores, int64_t* ids, float* weights) {
  for (int64_t e = 0; e < E; ++e) scores[e] = sigmoid(logits[e] * multiplier);
  std::vector<bool> taken(E, false);
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (!taken[e] && (best < 0 || scores[e] + bias[e] > scores[best] + bias[best])) best = e;
    taken[best] = true;
  }
  int64_t j = 0;
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e)
    if (taken[e]) {
      ids[j] = e;
      weights[j++] = scores[e];
      sum += scores[e];
    }
  for (j = 0; j < top_k; ++j) weights[j] = weights[j] / (sum + kRouterEps) * scaling;
}

// Rows [r0, r0 + n) of the gathered rows, all of expert x.
struct ExpertTask {
  int64_t x, r0, n;
};
constexpr int64_t kTaskRows = 256;  // an expert with more rows splits into near-equal tasks of at most this many

// The experts' rows as tasks for whole-expert threads (start: the counting sort's bounds),
// costliest first, when each thread can run its tasks alone: bf16 experts on the avx512_bf16
// path with batch invariance (musespark_gemv::run_job_here), several threads, and a greedy
// split of the tasks over the threads within 10 % of an even split of the work. Otherwise
// empty: the experts' tiles are split across the threads (two regions, gate/up and down).
// A task costs (rows + kTileFixedRows) per element of the expert's weights, as split_tiles
// counts. Either way each row is multiplied by the same kernel and tiles (rows are computed
// alone), so the results are the same.
std::vector<ExpertTask> whole_expert_tasks(const std::vector<int64_t>& start, const Weight& gate_up,
                                           const Weight& down, bool bf16) {
  const int64_t threads = at::get_num_threads(), E = static_cast<int64_t>(start.size()) - 1;
  if (threads < 2 || !bf16 || gate_up.nvfp4() || down.nvfp4() || gate_up.fp32 || down.fp32 ||
      !musespark_dispatch::bf16_products() || !musespark_isa::batch_invariant())
    return {};
  std::vector<ExpertTask> tasks;
  for (int64_t x = 0; x < E; ++x) {
    const int64_t n = start[x + 1] - start[x], pieces = (n + kTaskRows - 1) / kTaskRows;
    for (int64_t p = 0, r = start[x]; p < pieces; ++p) {
      const int64_t rows = n / pieces + (p < n % pieces ? 1 : 0);
      tasks.push_back({x, r, rows});
      r += rows;
    }
  }
  auto cost = [](const ExpertTask& t) { return t.n + musespark_gemv::kTileFixedRows; };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const ExpertTask& a, const ExpertTask& b) { return cost(a) > cost(b); });
  std::vector<int64_t> load(threads, 0);
  int64_t total = 0;
  for (const ExpertTask& t : tasks) {
    *std::min_element(load.begin(), load.end()) += cost(t);
    total += cost(t);
  }
  const int64_t makespan = *std::max_element(load.begin(), load.end());
  if (static_cast<double>(makespan) > 1.1 * static_cast<double>(total) / static_cast<double>(threads)) return {};
  return tasks;
}

}  // namespace

namespace musespark_ops {  // entry point: common/ops.h

using namespace musespark_block;

// s [T, H] fp32 -> s' [T, H] fp32, the compressed MoE (docs/spec.md §3):
//   f = bf16(rms(s) * pre_gain);  route f (fp32 router, above);
//   u = bf16(rms(bf16(f Wpre^T)) * expert_in_gain)                    pooler + pre-expert norm
//   y_e = bf16 SwiGLU expert e at width Hm (rounded like ffn_dense)
//   m = sum over the chosen e, in increasing id: rms(y_e * expert_out_gain) * weight_e  (fp32)
//   b = bf16(bf16(m) Wpost^T);  s' = alpha * s + beta * rms(b * post_gain).
// `eps` is rms_norm_eps (pre-norm, pre-expert norm), `post_eps` post_norm_eps (per-expert
// post-norm and the block's post-norm).
Tensor ffn_moe(const Tensor& s, const Tensor& pre_gain, double eps, const Tensor& router, const Tensor& bias,
               int64_t top_k, double output_multiplier, double routed_scaling, at::TensorList pre_expert_proj,
               const Tensor& expert_in_gain, at::TensorList gate_up_proj, at::TensorList down_proj,
               const Tensor& expert_out_gain, at::TensorList post_expert_proj, const Tensor& post_gain,
               double post_eps, const Tensor& alpha, const Tensor& beta, bool bf16,
               const c10::optional<Tensor>& prompt_rows) {
  check_stream(s, "ffn_moe");
  const Weight w_pre = weight_arg(pre_expert_proj, false, "ffn_moe: pre_expert_proj"),
               w_post = weight_arg(post_expert_proj, false, "ffn_moe: post_expert_proj"),
               gate_up = weight_arg(gate_up_proj, true, "ffn_moe: gate_up"),
               down = weight_arg(down_proj, true, "ffn_moe: down");
  const int64_t T = s.size(0), H = s.size(1), E = router.size(0), Hm = w_pre.N;
  const uint8_t* prompt = musespark_gemv::prompt_flags(prompt_rows, T, "ffn_moe");
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.is_contiguous() &&
                  router.size(1) == H,
              "ffn_moe: router must be a contiguous float32 [E, ", H, "]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "ffn_moe: top_k must be in [1, E]");
  const int64_t I = gate_up.N / 2;
  // Under expert parallelism this rank holds experts [first, first + local) of the E
  // (docs/parallel.md §3, plan.expert_range); other ranks' slots contribute zero here and the
  // weighted mix is summed over the ranks. TP-split experts: the down rows are partial sums,
  // summed over the ranks before the per-expert norm (blocks/tp_comm.h).
  const bool ep = musespark_tp::blocks_reduce() && musespark_tp::expert_parallel();
  const bool split_rows = musespark_tp::blocks_reduce() && !ep;
  const int64_t local = ep ? E / musespark_tp::world() + (musespark_tp::rank() < E % musespark_tp::world() ? 1 : 0) : E;
  const int64_t first = ep ? musespark_tp::rank() * (E / musespark_tp::world()) +
                                 std::min(musespark_tp::rank(), E % musespark_tp::world())
                           : 0;
  auto owned = [&](int64_t x) { return x >= first && x < first + local; };
  TORCH_CHECK(gate_up.E == local && gate_up.K == Hm && down.E == local && down.N == Hm && down.K == I && Hm % 8 == 0 &&
                  I % 8 == 0,
              "ffn_moe: gate_up and down must be [E, 2I, Hm] and [E, Hm, I] (as bf16 elements): their shapes disagree "
              "with the router and pooler (or Hm, I are not multiples of 8)");
  check_vector(pre_gain, H, "ffn_moe: pre_gain");
  check_vector(bias, E, "ffn_moe: bias");
  check_shape(w_pre, Hm, H, "ffn_moe: pre_expert_proj");
  check_vector(expert_in_gain, Hm, "ffn_moe: expert_in_gain");
  check_vector(expert_out_gain, Hm, "ffn_moe: expert_out_gain");
  check_shape(w_post, H, Hm, "ffn_moe: post_expert_proj");
  check_vector(post_gain, H, "ffn_moe: post_gain");
  check_residual(s, alpha, beta);
  const float e = static_cast<float>(eps), pe = static_cast<float>(post_eps);
  const float* f = pre_norm(s.data_ptr<float>(), T, H, pre_gain.data_ptr<float>(), e, bf16);

  // Router logits and the pooler in one region.
  float *logits = scratch(kLogits, T * E), *u = scratch(kPooled, T * Hm);
  run_jobs({musespark_gemv::job(f, T, H, router, logits, E, bf16), w_pre.job(f, T, u, Hm, bf16, 0, prompt)});
  const int64_t A = T * top_k;  // assignments, (t, j) order, j in increasing expert id
  std::vector<int64_t> ids(A);
  std::vector<float> weights(A);
  const float* in_gain = expert_in_gain.data_ptr<float>();
  for_rows(T, E + Hm, [&](int64_t t, float* tmp) {
    route_row(logits + t * E, bias.data_ptr<float>(), E, top_k, static_cast<float>(output_multiplier),
              static_cast<float>(routed_scaling), tmp, ids.data() + t * top_k, weights.data() + t * top_k);
    float* ur = u + t * Hm;
    round_row(ur, Hm, bf16);
    rms_row(ur, Hm, in_gain, e, false, 1.f, tmp + E, ur, !bf16);
    round_row(ur, Hm, bf16);
  });

  // Group the assignments by expert (counting sort, stable) so each expert's weights are read once.
  std::vector<int64_t> start(E + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) ++start[ids[a] + 1];
  for (int64_t x = 0; x < E; ++x) start[x + 1] += start[x];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[fill[ids[a]]++] = a;
  }
  std::vector<uint8_t> prompt_of;  // the prompt flag of each gathered row (its token's)
  if (prompt != nullptr) {
    prompt_of.resize(A);
    for (int64_t r = 0; r < A; ++r) prompt_of[r] = prompt[order[r] / top_k];
  }
  float* ys = scratch(kExpertOut, A * Hm);
  std::vector<ExpertTask> tasks = whole_expert_tasks(start, gate_up, down, bf16);
  if (ep) {
    tasks.erase(std::remove_if(tasks.begin(), tasks.end(), [&](const ExpertTask& t) { return !owned(t.x); }),
                tasks.end());
    for (int64_t x = 0; x < E; ++x)  // another rank's expert: zero rows here
      if (!owned(x)) std::fill(ys + start[x] * Hm, ys + start[x + 1] * Hm, 0.f);
  }
  if (!tasks.empty()) {
    // Each thread takes the next task (the costliest first) and runs it whole: gather its
    // rows, gate/up, SwiGLU, down, with the intermediates in the thread's own scratch
    // (cache-sized: at most kTaskRows rows) and no barrier between the products.
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
        const int64_t x = tasks[i].x, r0 = tasks[i].r0, n = tasks[i].n;
        const uint8_t* flags = prompt != nullptr ? prompt_of.data() + r0 : nullptr;
        float *xs = scratch(kExpertIn, n * Hm), *gu = scratch(kGateUp, n * 2 * I), *act = scratch(kAct, n * I);
        for (int64_t r = 0; r < n; ++r) std::copy_n(u + (order[r0 + r] / top_k) * Hm, Hm, xs + r * Hm);
        musespark_gemv::run_job_here(gate_up.job(xs, n, gu, 2 * I, bf16, x - first, flags));
        swiglu(gu, n, I, act, bf16);
        musespark_gemv::run_job_here(down.job(act, n, ys + r0 * Hm, Hm, bf16, x - first, flags));
      }
    });
  } else {
    float *xs = scratch(kExpertIn, A * Hm), *gu = scratch(kGateUp, A * 2 * I), *act = scratch(kAct, A * I);
    at::parallel_for(0, A, kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) std::copy_n(u + (order[r] / top_k) * Hm, Hm, xs + r * Hm);
    });
    std::vector<Job> up_jobs, down_jobs;
    for (int64_t x = 0; x < E; ++x) {
      const int64_t r0 = start[x], n = start[x + 1] - r0;
      if (n == 0 || !owned(x)) continue;
      const uint8_t* flags = prompt != nullptr ? prompt_of.data() + r0 : nullptr;
      up_jobs.push_back(gate_up.job(xs + r0 * Hm, n, gu + r0 * 2 * I, 2 * I, bf16, x - first, flags));
      down_jobs.push_back(down.job(act + r0 * I, n, ys + r0 * Hm, Hm, bf16, x - first, flags));
    }
    run_jobs(up_jobs);
    swiglu(gu, A, I, act, bf16);
    run_jobs(down_jobs);
  }
  if (split_rows) musespark_tp::all_reduce(ys, A * Hm);  // full expert rows before their norm
  std::vector<int64_t> row_of(A);  // assignment -> its row in ys
  for (int64_t r = 0; r < A; ++r) row_of[order[r]] = r;

  // Per-expert post-norm, weight, ordered sum; then the unpooler.
  float *m = scratch(kMixed, T * Hm), *b = scratch(kOut, T * H);
  const float* out_gain = expert_out_gain.data_ptr<float>();
  for_rows(T, 2 * Hm, [&](int64_t t, float* tmp) {
    float* mr = m + t * Hm;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t a = t * top_k + j;
      float* y = ys + row_of[a] * Hm;
      round_row(y, Hm, bf16);  // the expert's output in the model's dtype
      rms_row(y, Hm, out_gain, pe, true, 1.f, tmp, tmp + Hm, !bf16);
      for (int64_t i = 0; i < Hm; ++i) {
        const float z = tmp[Hm + i] * weights[a];
        mr[i] = j == 0 ? z : mr[i] + z;
      }
    }
    if (!ep) round_row(mr, Hm, bf16);
  });
  if (ep) {  // the mix of every rank's slots, then rounded once
    musespark_tp::all_reduce(m, T * Hm);
    for_rows(T, 0, [&](int64_t t, float*) { round_row(m + t * Hm, Hm, bf16); });
  }
  run_jobs({w_post.job(m, T, b, H, bf16, 0, prompt)});
  return residual(s, b, post_gain.data_ptr<float>(), pe, alpha, beta, bf16);
}

}  // namespace musespark_ops

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("ffn_dense(Tensor s, Tensor pre_gain, float eps, Tensor[] w_gate, Tensor[] w_up, Tensor[] w_down, "
        "Tensor post_gain, float post_eps, Tensor alpha, Tensor beta, bool bf16=True, Tensor? prompt_rows=None) "
        "-> Tensor");
  m.def("ffn_moe(Tensor s, Tensor pre_gain, float eps, Tensor router, Tensor bias, int top_k, "
        "float output_multiplier, float routed_scaling, Tensor[] w_pre, Tensor expert_in_gain, Tensor[] gate_up, "
        "Tensor[] down, Tensor expert_out_gain, Tensor[] w_post, Tensor post_gain, float post_eps, Tensor alpha, "
        "Tensor beta, bool bf16=True, Tensor? prompt_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("ffn_dense", &musespark_ops::ffn_dense);
  m.impl("ffn_moe", &musespark_ops::ffn_moe);
}
