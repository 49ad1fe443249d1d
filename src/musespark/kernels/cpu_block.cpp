// Fused decoder sub-blocks for bf16 models on x86 CPUs (AVX2+FMA): one call each for
//   attn_in   input norm, Q/K/V/gate projections, QK-norm and rotary;
//   attn_out  O-norm and sigmoid gate, O projection, post-norm and gated residual;
//   ffn_dense pre-norm, SwiGLU MLP, post-norm and gated residual;
//   ffn_moe   pre-norm, router, pooler, pre-expert norm, the chosen experts, per-expert
//             post-norm, weighting and ordered sum, unpooler, post-norm, gated residual.
// The attention itself stays outside (layers/attention.py), so these serve every batch:
// prefill, decode and mixed.
//
// Why: a decode step multiplies one row per sequence by every weight, and in PyTorch each
// of a layer's ~70 small ops costs more in dispatch than in arithmetic. Here a layer is
// four calls, and the products of a step (q/k/v/gate; router and pooler; every chosen
// expert) share one parallel region.
//
// Numerics (SPEC §2-3), the same formulas as the PyTorch modules: the residual stream s is
// fp32 [T, H]; every norm computes in fp32; each value the bf16 model stores (a norm's
// output, each linear's output, silu, the SwiGLU product, the attention output) is rounded
// to bf16 where PyTorch would round it. Every row is computed by itself in a fixed order
// (cpu_gemv.h, cpu_rows.h), so a token's result never depends on its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_gemv.h"
#include "cpu_rows.h"

#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using musespark_gemv::Job;
using musespark_gemv::job;
using musespark_gemv::run_jobs;
using musespark_rows::gated_residual_row;
using musespark_rows::rms_row;
using musespark_rows::rope_row;
using musespark_rows::round_bf16;
using musespark_rows::sigmoid;

constexpr int64_t kRowGrain = 16;  // rows per task in row loops (T = 1 runs inline)
constexpr float kRouterEps = 1e-15f;

void check_weight(const Tensor& w, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), name,
              " must be a contiguous bfloat16 matrix");
  TORCH_CHECK(w.size(0) == N && w.size(1) == K, name, " must be [", N, ", ", K, "], got ", w.sizes());
}

void check_vector(const Tensor& v, int64_t n, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.scalar_type() == at::kFloat && v.is_contiguous() && v.size(0) == n, name,
              " must be a contiguous float32 [", n, "]");
}

void check_stream(const Tensor& s, const char* op) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(1) % 8 == 0, op,
              ": s must be the contiguous float32 stream [T, H], H a multiple of 8");
}

void round_all(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = round_bf16(p[i]);
}

// Row-parallel loop with H floats of per-task scratch.
template <typename F>
void for_rows(int64_t T, int64_t scratch, const F& f) {
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(scratch);
    for (int64_t t = t0; t < t1; ++t) f(t, tmp.data());
  });
}

// h[t] = bf16(rms(s[t]) * gain), kept as floats for the products.
std::vector<float> pre_norm(const float* s, int64_t T, int64_t H, const float* gain, float eps) {
  std::vector<float> h(T * H);
  for_rows(T, H, [&](int64_t t, float* tmp) {
    rms_row(s + t * H, H, gain, eps, false, 1.f, tmp, h.data() + t * H);
    round_all(h.data() + t * H, H);
  });
  return h;
}

// The stream update shared by both halves of a layer: s' = alpha * s + beta * norm(b),
// norm weightless (gain null) or input-scaled by gain. b [T, H] holds bf16 values.
Tensor residual(const Tensor& s, const float* b, const float* gain, float eps, const Tensor& alpha,
                const Tensor& beta) {
  const int64_t T = s.size(0), H = s.size(1);
  Tensor out = s.clone();
  float* op = out.data_ptr<float>();
  const float *ap = alpha.data_ptr<float>(), *bp = beta.data_ptr<float>();
  for_rows(T, 2 * H, [&](int64_t t, float* tmp) {
    rms_row(b + t * H, H, gain, eps, gain != nullptr, 1.f, tmp, tmp + H);
    gated_residual_row(op + t * H, tmp + H, ap, bp, H);
  });
  return out;
}

void check_residual(const Tensor& s, const Tensor& alpha, const Tensor& beta) {
  check_vector(alpha, s.size(1), "alpha");
  check_vector(beta, s.size(1), "beta");
}

// s [T, H] fp32 -> (q [T, nH, D], k [T, nKV, D], v [T, nKV, D], g [T, nH, D]) bf16:
//   h = bf16(rms(s) * gain);  q, k, v, g = bf16(h W^T);
//   q = bf16(rope(rms(q_head) * qk_scale)), k = bf16(rope(rms(k_head))) (no rope without cos/sin).
// `eps` is the model's rms_norm_eps (input norm and QK-norm).
std::tuple<Tensor, Tensor, Tensor, Tensor> attn_in(const Tensor& s, const Tensor& gain, double eps, const Tensor& wq,
                                                   const Tensor& wk, const Tensor& wv, const Tensor& wg,
                                                   int64_t num_heads, int64_t num_kv_heads, double qk_scale,
                                                   const c10::optional<Tensor>& cos,
                                                   const c10::optional<Tensor>& sin) {
  check_stream(s, "attn_in");
  const int64_t T = s.size(0), H = s.size(1);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && wq.dim() == 2 && wq.size(0) % num_heads == 0,
              "attn_in: q_proj rows must split into num_heads heads");
  const int64_t D = wq.size(0) / num_heads, nH = num_heads, nKV = num_kv_heads;
  check_vector(gain, H, "attn_in: gain");
  check_weight(wq, nH * D, H, "attn_in: q_proj");
  check_weight(wk, nKV * D, H, "attn_in: k_proj");
  check_weight(wv, nKV * D, H, "attn_in: v_proj");
  check_weight(wg, nH * D, H, "attn_in: gate_proj");
  const bool rope = cos.has_value() && cos->defined();
  if (rope) {
    TORCH_CHECK(sin.has_value() && sin->defined() && D % 2 == 0, "attn_in: rotary needs cos and sin, even head_dim");
    for (const Tensor* c : {&cos.value(), &sin.value()})
      TORCH_CHECK(c->dim() == 2 && c->size(0) == T && c->size(1) == D && c->scalar_type() == at::kFloat &&
                      c->is_contiguous(),
                  "attn_in: cos/sin must be contiguous float32 [T, head_dim]");
  }
  const float e = static_cast<float>(eps);
  std::vector<float> h = pre_norm(s.data_ptr<float>(), T, H, gain.data_ptr<float>(), e);
  // One row of `proj` is [q | k | v | g].
  const int64_t W = (2 * nH + 2 * nKV) * D, ok = nH * D, ov = ok + nKV * D, og = ov + nKV * D;
  std::vector<float> proj(T * W);
  run_jobs({job(h.data(), T, H, wq, proj.data(), W), job(h.data(), T, H, wk, proj.data() + ok, W),
            job(h.data(), T, H, wv, proj.data() + ov, W), job(h.data(), T, H, wg, proj.data() + og, W)});
  auto opts = s.options().dtype(at::kBFloat16);
  Tensor q = at::empty({T, nH, D}, opts), k = at::empty({T, nKV, D}, opts), v = at::empty({T, nKV, D}, opts),
         g = at::empty({T, nH, D}, opts);
  auto *qp = q.data_ptr<at::BFloat16>(), *kp = k.data_ptr<at::BFloat16>(), *vp = v.data_ptr<at::BFloat16>(),
       *gp = g.data_ptr<at::BFloat16>();
  const float* cp = rope ? cos->data_ptr<float>() : nullptr;
  const float* sp = rope ? sin->data_ptr<float>() : nullptr;
  const float qs = static_cast<float>(qk_scale);
  for_rows(T, 3 * D, [&](int64_t t, float* tmp) {
    float* row = proj.data() + t * W;
    round_all(row, W);  // the projections' outputs are bf16
    float *r = tmp, *scratch = tmp + D, *norm = tmp + 2 * D;
    auto head = [&](const float* x, float scale, at::BFloat16* out) {
      rms_row(x, D, nullptr, e, false, scale, norm, r);
      if (rope) rope_row(r, cp + t * D, sp + t * D, D, scratch);
      for (int64_t i = 0; i < D; ++i) out[i] = at::BFloat16(r[i]);
    };
    for (int64_t i = 0; i < nH; ++i) head(row + i * D, qs, qp + (t * nH + i) * D);
    for (int64_t i = 0; i < nKV; ++i) head(row + ok + i * D, 1.f, kp + (t * nKV + i) * D);
    for (int64_t i = 0; i < nKV * D; ++i) vp[t * nKV * D + i] = at::BFloat16(row[ov + i]);
    for (int64_t i = 0; i < nH * D; ++i) gp[t * nH * D + i] = at::BFloat16(row[og + i]);
  });
  return {q, k, v, g};
}

// s [T, H] fp32, o and g [T, nH, D] bf16 -> s' [T, H] fp32:
//   x = bf16(rms(o_head) * sigmoid(g));  a = bf16(x Wo^T);  s' = alpha * s + beta * rms(a).
// `eps` is the O-norm's (rms_norm_eps), `post_eps` the weightless post-attention norm's.
Tensor attn_out(const Tensor& s, const Tensor& o, const Tensor& g, const Tensor& wo, double eps, const Tensor& alpha,
                const Tensor& beta, double post_eps) {
  check_stream(s, "attn_out");
  const int64_t T = s.size(0), H = s.size(1);
  TORCH_CHECK(o.dim() == 3 && o.size(0) == T && o.scalar_type() == at::kBFloat16 && o.is_contiguous() &&
                  g.sizes() == o.sizes() && g.scalar_type() == at::kBFloat16 && g.is_contiguous(),
              "attn_out: o and g must be contiguous bfloat16 [T, heads, head_dim] alike");
  const int64_t nH = o.size(1), D = o.size(2);
  check_weight(wo, H, nH * D, "attn_out: o_proj");
  check_residual(s, alpha, beta);
  const float e = static_cast<float>(eps);
  std::vector<float> x(T * nH * D), a(T * H);
  const auto *op = o.data_ptr<at::BFloat16>(), *gp = g.data_ptr<at::BFloat16>();
  for_rows(T, D, [&](int64_t t, float* tmp) {
    for (int64_t i = 0; i < nH; ++i) {
      const int64_t base = (t * nH + i) * D;
      rms_row(op + base, D, nullptr, e, false, 1.f, tmp, x.data() + base);
      for (int64_t j = 0; j < D; ++j)
        x[base + j] = round_bf16(x[base + j] * sigmoid(static_cast<float>(gp[base + j])));
    }
  });
  run_jobs({job(x.data(), T, nH * D, wo, a.data(), H)});
  round_all(a.data(), T * H);
  return residual(s, a.data(), nullptr, static_cast<float>(post_eps), alpha, beta);
}

// act = bf16(bf16(silu(gate)) * up) over n rows of [gate | up] (2I wide, bf16 values).
void swiglu(const float* gu, int64_t n, int64_t I, float* act) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float gate = gu[r * 2 * I + i], up = gu[r * 2 * I + I + i];
      act[r * I + i] = round_bf16(round_bf16(gate / (1.f + std::exp(-gate))) * up);
    }
}

// s [T, H] fp32 -> s' [T, H] fp32, a dense SwiGLU MLP:
//   f = bf16(rms(s) * pre_gain);  b = bf16(bf16(silu(bf16(f Wg^T)) * bf16(f Wu^T)) Wd^T);
//   s' = alpha * s + beta * rms(b * post_gain)   (the input-scaled post-norm, post_eps).
Tensor ffn_dense(const Tensor& s, const Tensor& pre_gain, double eps, const Tensor& w_gate, const Tensor& w_up,
                 const Tensor& w_down, const Tensor& post_gain, double post_eps, const Tensor& alpha,
                 const Tensor& beta) {
  check_stream(s, "ffn_dense");
  const int64_t T = s.size(0), H = s.size(1), I = w_gate.size(0);
  check_vector(pre_gain, H, "ffn_dense: pre_gain");
  check_vector(post_gain, H, "ffn_dense: post_gain");
  check_weight(w_gate, I, H, "ffn_dense: gate_proj");
  check_weight(w_up, I, H, "ffn_dense: up_proj");
  check_weight(w_down, H, I, "ffn_dense: down_proj");
  TORCH_CHECK(I % 8 == 0, "ffn_dense: intermediate size must be a multiple of 8");
  check_residual(s, alpha, beta);
  std::vector<float> f = pre_norm(s.data_ptr<float>(), T, H, pre_gain.data_ptr<float>(), static_cast<float>(eps));
  std::vector<float> gu(T * 2 * I), act(T * I), b(T * H);
  run_jobs({job(f.data(), T, H, w_gate, gu.data(), 2 * I), job(f.data(), T, H, w_up, gu.data() + I, 2 * I)});
  round_all(gu.data(), T * 2 * I);
  swiglu(gu.data(), T, I, act.data());
  run_jobs({job(act.data(), T, I, w_down, b.data(), H)});
  round_all(b.data(), T * H);
  return residual(s, b.data(), post_gain.data_ptr<float>(), static_cast<float>(post_eps), alpha, beta);
}

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

// s [T, H] fp32 -> s' [T, H] fp32, the compressed MoE (SPEC §3):
//   f = bf16(rms(s) * pre_gain);  route f (fp32 router, above);
//   u = bf16(rms(bf16(f Wpre^T)) * expert_in_gain)                    pooler + pre-expert norm
//   y_e = bf16 SwiGLU expert e at width Hm (rounded like ffn_dense)
//   m = sum over the chosen e, in increasing id: rms(y_e * expert_out_gain) * weight_e  (fp32)
//   b = bf16(bf16(m) Wpost^T);  s' = alpha * s + beta * rms(b * post_gain).
// `eps` is rms_norm_eps (pre-norm, pre-expert norm), `post_eps` post_norm_eps (per-expert
// post-norm and the block's post-norm).
Tensor ffn_moe(const Tensor& s, const Tensor& pre_gain, double eps, const Tensor& router, const Tensor& bias,
               int64_t top_k, double output_multiplier, double routed_scaling, const Tensor& w_pre,
               const Tensor& expert_in_gain, const Tensor& gate_up, const Tensor& down, const Tensor& expert_out_gain,
               const Tensor& w_post, const Tensor& post_gain, double post_eps, const Tensor& alpha,
               const Tensor& beta) {
  check_stream(s, "ffn_moe");
  const int64_t T = s.size(0), H = s.size(1), E = router.size(0), Hm = w_pre.size(0);
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.is_contiguous() &&
                  router.size(1) == H,
              "ffn_moe: router must be a contiguous float32 [E, ", H, "]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "ffn_moe: top_k must be in [1, E]");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kBFloat16 &&
                  down.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() && down.is_contiguous(),
              "ffn_moe: gate_up and down must be contiguous bfloat16 [E, 2I, Hm] and [E, Hm, I]");
  const int64_t I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(0) == E && gate_up.size(2) == Hm && down.size(0) == E && down.size(1) == Hm &&
                  down.size(2) == I && Hm % 8 == 0 && I % 8 == 0,
              "ffn_moe: expert shapes disagree with the router and pooler (or Hm, I not multiples of 8)");
  check_vector(pre_gain, H, "ffn_moe: pre_gain");
  check_vector(bias, E, "ffn_moe: bias");
  check_weight(w_pre, Hm, H, "ffn_moe: pre_expert_proj");
  check_vector(expert_in_gain, Hm, "ffn_moe: expert_in_gain");
  check_vector(expert_out_gain, Hm, "ffn_moe: expert_out_gain");
  check_weight(w_post, H, Hm, "ffn_moe: post_expert_proj");
  check_vector(post_gain, H, "ffn_moe: post_gain");
  check_residual(s, alpha, beta);
  const float e = static_cast<float>(eps), pe = static_cast<float>(post_eps);
  std::vector<float> f = pre_norm(s.data_ptr<float>(), T, H, pre_gain.data_ptr<float>(), e);

  // Router logits and the pooler in one region.
  std::vector<float> logits(T * E), u(T * Hm);
  run_jobs({job(f.data(), T, H, router, logits.data(), E), job(f.data(), T, H, w_pre, u.data(), Hm)});
  const int64_t A = T * top_k;  // assignments, (t, j) order, j in increasing expert id
  std::vector<int64_t> ids(A);
  std::vector<float> weights(A);
  const float* in_gain = expert_in_gain.data_ptr<float>();
  for_rows(T, E + Hm, [&](int64_t t, float* tmp) {
    route_row(logits.data() + t * E, bias.data_ptr<float>(), E, top_k, static_cast<float>(output_multiplier),
              static_cast<float>(routed_scaling), tmp, ids.data() + t * top_k, weights.data() + t * top_k);
    float* ur = u.data() + t * Hm;
    round_all(ur, Hm);
    rms_row(ur, Hm, in_gain, e, false, 1.f, tmp + E, ur);
    round_all(ur, Hm);
  });

  // Group the assignments by expert (counting sort, stable) so each expert's weights are read once.
  std::vector<int64_t> start(E + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) ++start[ids[a] + 1];
  for (int64_t x = 0; x < E; ++x) start[x + 1] += start[x];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[fill[ids[a]]++] = a;
  }
  std::vector<float> xs(A * Hm), gu(A * 2 * I), act(A * I), ys(A * Hm);
  for (int64_t r = 0; r < A; ++r) std::copy_n(u.data() + (order[r] / top_k) * Hm, Hm, xs.data() + r * Hm);
  const auto* gup = gate_up.data_ptr<at::BFloat16>();
  const auto* dnp = down.data_ptr<at::BFloat16>();
  std::vector<Job> up_jobs, down_jobs;
  for (int64_t x = 0; x < E; ++x) {
    const int64_t r0 = start[x], n = start[x + 1] - r0;
    if (n == 0) continue;
    up_jobs.push_back(Job{xs.data() + r0 * Hm, n, Hm, gup + x * 2 * I * Hm, true, 2 * I, gu.data() + r0 * 2 * I, 2 * I});
    down_jobs.push_back(Job{act.data() + r0 * I, n, I, dnp + x * Hm * I, true, Hm, ys.data() + r0 * Hm, Hm});
  }
  run_jobs(up_jobs);
  round_all(gu.data(), A * 2 * I);
  swiglu(gu.data(), A, I, act.data());
  run_jobs(down_jobs);
  round_all(ys.data(), A * Hm);
  std::vector<int64_t> row_of(A);  // assignment -> its row in ys
  for (int64_t r = 0; r < A; ++r) row_of[order[r]] = r;

  // Per-expert post-norm, weight, ordered sum; then the unpooler.
  std::vector<float> m(T * Hm), b(T * H);
  const float* out_gain = expert_out_gain.data_ptr<float>();
  for_rows(T, 2 * Hm, [&](int64_t t, float* tmp) {
    float* mr = m.data() + t * Hm;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t a = t * top_k + j;
      rms_row(ys.data() + row_of[a] * Hm, Hm, out_gain, pe, true, 1.f, tmp, tmp + Hm);
      for (int64_t i = 0; i < Hm; ++i) {
        const float z = tmp[Hm + i] * weights[a];
        mr[i] = j == 0 ? z : mr[i] + z;
      }
    }
    round_all(mr, Hm);
  });
  run_jobs({job(m.data(), T, Hm, w_post, b.data(), H)});
  round_all(b.data(), T * H);
  return residual(s, b.data(), post_gain.data_ptr<float>(), pe, alpha, beta);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("attn_in(Tensor s, Tensor gain, float eps, Tensor wq, Tensor wk, Tensor wv, Tensor wg, int num_heads, "
        "int num_kv_heads, float qk_scale, Tensor? cos, Tensor? sin) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("attn_out(Tensor s, Tensor o, Tensor g, Tensor wo, float eps, Tensor alpha, Tensor beta, float post_eps) "
        "-> Tensor");
  m.def("ffn_dense(Tensor s, Tensor pre_gain, float eps, Tensor w_gate, Tensor w_up, Tensor w_down, "
        "Tensor post_gain, float post_eps, Tensor alpha, Tensor beta) -> Tensor");
  m.def("ffn_moe(Tensor s, Tensor pre_gain, float eps, Tensor router, Tensor bias, int top_k, "
        "float output_multiplier, float routed_scaling, Tensor w_pre, Tensor expert_in_gain, Tensor gate_up, "
        "Tensor down, Tensor expert_out_gain, Tensor w_post, Tensor post_gain, float post_eps, Tensor alpha, "
        "Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("attn_in", &attn_in);
  m.impl("attn_out", &attn_out);
  m.impl("ffn_dense", &ffn_dense);
  m.impl("ffn_moe", &ffn_moe);
}
